//! Every registered architecture's stem, layers and head are gathered and released by the
//! framework under the names `DiffusionModel::layers` lists, in that order, and every parameter belongs to
//! one of them (`residency::units`): what fully sharded training relies on to gather and release
//! each unit's weights.

use std::cell::RefCell;

use flux_model::execution::residency::{install, units, LayerParams, STEM};
use flux_model::tp::{Pass, TpContext};
use flux_model::DiffusionBatch;
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

#[test]
fn every_architecture_runs_its_layers_under_their_parameters_prefixes() {
    for architecture in flux_model::ARCHITECTURES {
        let spec = architecture.tiny();
        tch::manual_seed(0);
        let model = spec.build(Device::Cpu, TpContext::single()).unwrap();
        let layers = model.layers();
        assert!(!layers.is_empty(), "{}", architecture.name);

        // Every parameter is in a listed unit, and every listed unit has parameters.
        let names: Vec<&str> = model
            .store()
            .param_specs()
            .iter()
            .map(|s| s.name.as_str())
            .collect();
        let units = units(&names);
        for (name, unit) in names.iter().zip(&units) {
            let listed = layers.iter().any(|l| l == unit);
            assert!(listed, "{}: {name} is in `{unit}`", architecture.name);
        }
        for layer in &layers {
            let held = units.contains(&layer.as_str());
            assert!(held, "{}: `{layer}` holds no parameter", architecture.name);
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
        // Backward reaches the layers in reverse. The stem comes last, and earlier too where
        // the layers it conditions end before the first (FLUX.2's single-stream modulation).
        assert_eq!(regathered.last().unwrap().as_str(), STEM);
        regathered.retain(|l| l.as_str() != STEM);
        regathered.dedup();
        let reversed: Vec<&String> = layers.iter().rev().filter(|l| *l != STEM).collect();
        assert_eq!(regathered, reversed, "{}", architecture.name);
    }
}
