//! Every registered architecture runs its layers through `residency::run_layer` under the names
//! `DiffusionModel::layers` lists, in that order, and those names are the state-dict prefixes of
//! all its per-layer parameters: what fully sharded training relies on to gather and release
//! each layer's weights.

use std::cell::RefCell;

use flux_model::residency::{install, LayerParams};
use flux_model::tp::{Pass, TpContext};
use flux_model::{DiffusionBatch, ModelSpec};
use tch::{Device, Kind};

/// Records the layers a forward pass gathers and releases.
#[derive(Default)]
struct Recorder(RefCell<Vec<(String, &'static str)>>);

impl LayerParams for Recorder {
    fn gather(&self, layer: &str, pass: Pass) {
        let what = match pass {
            Pass::Forward => "gather",
            Pass::Backward => "regather",
        };
        self.0.borrow_mut().push((layer.to_string(), what));
    }

    fn release(&self, layer: &str) {
        self.0.borrow_mut().push((layer.to_string(), "release"));
    }
}

/// Whether a state-dict name has an all-digit component (a layer index).
fn in_a_layer(name: &str) -> bool {
    name.split('.')
        .any(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

#[test]
fn every_architecture_runs_its_layers_under_their_parameters_prefixes() {
    for architecture in flux_model::ARCHITECTURES {
        let file = format!(
            "{}/../configs/{}_tiny.toml",
            env!("CARGO_MANIFEST_DIR"),
            architecture.name
        );
        let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{file}: {e}"));
        let mut run: toml::Table = toml::from_str(&text).unwrap();
        let table = run.remove("model").unwrap().try_into().unwrap();
        let spec = ModelSpec::from_table(table).unwrap();
        tch::manual_seed(0);
        let model = spec.build(Device::Cpu, TpContext::single()).unwrap();
        let layers = model.layers();
        assert!(!layers.is_empty(), "{}", architecture.name);

        // Every per-layer parameter is under exactly one listed layer.
        for s in model.store().param_specs() {
            let under = layers
                .iter()
                .filter(|l| s.name.starts_with(&format!("{l}.")))
                .count();
            let expected = usize::from(in_a_layer(&s.name));
            assert_eq!(under, expected, "{}: {}", architecture.name, s.name);
        }

        // A training forward and backward run each layer under its name, in order: gathered,
        // released, and gathered again (once per output) by backward, in reverse.
        let inputs = spec.inputs();
        let batch = DiffusionBatch::random(&inputs, 1, 8, 8, 4, Device::Cpu);
        let recorder = Recorder::default();
        // SAFETY: the recorder outlives the guard, dropped at the end of this scope.
        let guard = unsafe { install(&recorder) };
        let out = model.forward(&batch, true).unwrap();
        out.to_kind(Kind::Float).sum(Kind::Float).backward();
        drop(guard);
        let events = recorder.0.into_inner();
        let forward: Vec<(String, &str)> = layers
            .iter()
            .flat_map(|l| [(l.clone(), "gather"), (l.clone(), "release")])
            .collect();
        assert_eq!(
            events[..forward.len()],
            forward[..],
            "{}",
            architecture.name
        );
        let mut regathered: Vec<&String> = events[forward.len()..]
            .iter()
            .map(|(l, what)| {
                assert_eq!(*what, "regather");
                l
            })
            .collect();
        regathered.dedup();
        let reversed: Vec<&String> = layers.iter().rev().collect();
        assert_eq!(regathered, reversed, "{}", architecture.name);
    }
}
