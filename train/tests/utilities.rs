//! Noise, losses, timestep samplers, scheduler, sampling and optimizer against closed forms and
//! against diffusers' scheduler tables (tests/fixtures/make_scheduler_fixtures.py).

use approx::assert_abs_diff_eq;
use flux_train::optimizer::optim::{learning_rate, AdamW};
use flux_train::sampling::guided_velocity;
use flux_train::scheduler::{integrate, DynamicShift, FlowMatchEulerDiscreteScheduler};
use flux_train::step::loss::{
    compute_diffusion_loss, compute_flow_matching_loss, Prediction, Reduction,
};
use flux_train::step::noise::{apply_ddpm_noise, apply_flow_matching_noise};
use flux_train::step::timesteps::TimestepSampler;
use flux_train::{LrSchedule, OptimizationConfig};
use tch::{Device, Kind, Tensor};

fn t(v: &[f32]) -> Tensor {
    Tensor::from_slice(v)
}

fn values(x: &Tensor) -> Vec<f64> {
    Vec::<f64>::try_from(x.to_kind(Kind::Double).flatten(0, -1)).unwrap()
}

#[test]
fn forward_processes_mix_as_written() {
    let x0 = t(&[2.0, -1.0]).view([2, 1]);
    let noise = t(&[1.0, 3.0]).view([2, 1]);
    let fm = values(&apply_flow_matching_noise(&x0, &noise, &t(&[0.25, 1.0])));
    assert_eq!(fm, [0.75 * 2.0 + 0.25 * 1.0, 3.0]);
    let ddpm = values(&apply_ddpm_noise(&x0, &noise, &t(&[0.64, 0.36])));
    assert_abs_diff_eq!(ddpm[0], 0.8 * 2.0 + 0.6 * 1.0, epsilon = 1e-6);
    assert_abs_diff_eq!(ddpm[1], -0.6 + 0.8 * 3.0, epsilon = 1e-6); // √0.36·(−1) + √0.64·3
}

#[test]
fn targets_and_reductions_have_their_closed_forms() {
    let x0 = t(&[1.0, 2.0]).view([2, 1]);
    let noise = t(&[3.0, 5.0]).view([2, 1]);
    let sigma = t(&[0.5, 0.25]);
    assert_eq!(
        values(&Prediction::FlowMatching.target(&x0, &noise, &sigma)),
        [2.0, 3.0]
    );
    assert_eq!(
        values(&Prediction::Epsilon.target(&x0, &noise, &sigma)),
        [3.0, 5.0]
    );
    assert_eq!(
        values(&Prediction::VPrediction.target(&x0, &noise, &sigma)),
        [0.5 * 3.0 - 0.5, 0.25 * 5.0 - 0.75 * 2.0]
    );

    let pred = t(&[0.0, 0.0, 0.0]);
    let target = t(&[0.5, -2.0, 3.0]);
    let loss = |r| compute_diffusion_loss(&pred, &target, r, None).double_value(&[]);
    assert_abs_diff_eq!(
        loss(Reduction::Mse),
        (0.25 + 4.0 + 9.0) / 3.0,
        epsilon = 1e-6
    );
    assert_abs_diff_eq!(loss(Reduction::Mae), 5.5 / 3.0, epsilon = 1e-6);
    // Huber, δ = 1: 0.5·0.25, then 1·(2 − 0.5), 1·(3 − 0.5).
    assert_abs_diff_eq!(
        loss(Reduction::Huber { delta: 1.0 }),
        (0.125 + 1.5 + 2.5) / 3.0,
        epsilon = 1e-6
    );
    // A mask weights each sample's mean over its elements: sample 0 keeps its first element,
    // sample 1 weights its two by 1 and 3; all-ones weights are the plain mean.
    let pred = Tensor::zeros([2, 2], (Kind::Float, Device::Cpu));
    let target = t(&[1.0, 2.0, 3.0, 5.0]).view([2, 2]);
    let masked = |w: &[f32]| {
        let w = t(w).view([2, 2]);
        compute_diffusion_loss(&pred, &target, Reduction::Mse, Some(&w)).double_value(&[])
    };
    assert_abs_diff_eq!(
        masked(&[1.0, 0.0, 1.0, 3.0]),
        (1.0 + (9.0 + 75.0) / 4.0) / 2.0,
        epsilon = 1e-5
    );
    assert_abs_diff_eq!(
        masked(&[1.0, 1.0, 1.0, 1.0]),
        (1.0 + 4.0 + 9.0 + 25.0) / 4.0,
        epsilon = 1e-5
    );
    assert_abs_diff_eq!(masked(&[0.0, 0.0, 1.0, 1.0]), 17.0 / 2.0, epsilon = 1e-5);
    let fm = compute_flow_matching_loss(&t(&[2.0, 3.0]), &x0.view([2]), &noise.view([2]))
        .double_value(&[]);
    assert_eq!(fm, 0.0);
}

#[test]
fn samplers_map_their_draws_to_bins() {
    let scheduler = FlowMatchEulerDiscreteScheduler::new(1000, 1.0, None);
    let u = t(&[0.25, 0.0, 0.9999]);
    let z = t(&[0.0, 0.0, 0.0]);
    let (ts, sig) = TimestepSampler::from_name("uniform")
        .unwrap()
        .sample(&u, &z, &scheduler);
    // Bin 250 of the training table is σ = 750/1000; bin 999 is σ = 1/1000.
    assert_eq!(
        values(&sig),
        [0.75, 1.0, 0.001].map(|v: f64| v as f32 as f64)
    );
    assert_eq!(values(&ts), [750.0, 1000.0, 1.0]);
    // Logit-normal with z = 0: sigmoid(0) = 0.5 → bin 500 → σ = 0.5.
    let (_, sig) = TimestepSampler::from_name("logit_normal")
        .unwrap()
        .sample(&u, &z, &scheduler);
    assert_eq!(values(&sig)[0], 0.5);
    // Mode (s = 1.29) at u = 0.25: 1 − u − s·(cos²(πu/2) − 1 + u).
    let expected = 1.0 - 0.25 - 1.29 * ((std::f64::consts::PI * 0.125).cos().powi(2) - 1.0 + 0.25);
    let bin = (expected * 1000.0) as usize;
    let (_, sig) = TimestepSampler::from_name("mode")
        .unwrap()
        .sample(&u, &z, &scheduler);
    assert_abs_diff_eq!(values(&sig)[0], scheduler.train_sigmas[bin], epsilon = 1e-6);
    let (ts, sig) = TimestepSampler::from_name("direct_uniform")
        .unwrap()
        .sample(&u, &z, &scheduler);
    assert_eq!((values(&ts)[0], values(&sig)[0]), (250.0, 0.25));
    let err = TimestepSampler::from_name("cosine").unwrap_err();
    assert!(
        err.contains("unknown timestep sampling strategy \"cosine\""),
        "{err}"
    );
}

#[derive(serde::Deserialize)]
struct Case {
    shift: f64,
    dynamic: bool,
    steps: usize,
    image_seq_len: f64,
    train_sigmas: Vec<f64>,
    train_timesteps: Vec<f64>,
    default_sigmas: Vec<f64>,
    default_timesteps: Vec<f64>,
    flux_sigmas: Vec<f64>,
    flux_timesteps: Vec<f64>,
}

fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "{what}[{i}]: {g} vs diffusers {w}"
        );
    }
}

#[test]
fn scheduler_tables_match_diffusers() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/data/scheduler.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run tests/fixtures/make_scheduler_fixtures.py",
            path.display()
        )
    });
    let cases: Vec<Case> = serde_json::from_str(&text).unwrap();
    assert_eq!(cases.len(), 5);
    // diffusers keeps its tables in f32: 1e-6 relative.
    for c in cases {
        let s = FlowMatchEulerDiscreteScheduler::new(
            1000,
            c.shift,
            c.dynamic.then(DynamicShift::default),
        );
        let name = format!(
            "shift {} dynamic {} steps {} seq {}",
            c.shift, c.dynamic, c.steps, c.image_seq_len
        );
        assert_close(
            &format!("{name} train sigmas"),
            &s.train_sigmas,
            &c.train_sigmas,
            1e-6,
        );
        assert_close(
            &format!("{name} train timesteps"),
            &s.train_timesteps,
            &c.train_timesteps,
            1e-6,
        );
        let d = s.set_timesteps(c.steps, c.image_seq_len);
        assert_close(
            &format!("{name} sigmas"),
            &d.sigmas,
            &c.default_sigmas,
            1e-6,
        );
        assert_close(
            &format!("{name} timesteps"),
            &d.timesteps,
            &c.default_timesteps,
            1e-6,
        );
        let f = s.flux_schedule(c.steps, c.image_seq_len);
        assert_close(
            &format!("{name} flux sigmas"),
            &f.sigmas,
            &c.flux_sigmas,
            1e-6,
        );
        assert_close(
            &format!("{name} flux timesteps"),
            &f.timesteps,
            &c.flux_timesteps,
            1e-6,
        );
    }
}

#[test]
fn euler_and_heun_recover_x0_from_the_exact_velocity() {
    // For x_σ = (1 − σ)·x₀ + σ·ε the exact velocity at (x, σ) is (x − x₀)/σ.
    let x0 = Tensor::randn([2, 4, 3, 3], (Kind::Float, Device::Cpu));
    let noise = Tensor::randn([2, 4, 3, 3], (Kind::Float, Device::Cpu));
    let schedule = FlowMatchEulerDiscreteScheduler::flux().flux_schedule(8, 1024.0);
    for heun in [false, true] {
        let out = integrate(noise.shallow_clone(), &schedule.sigmas, heun, |x, s| {
            (x - &x0) / s
        });
        let err = (out - &x0).abs().max().double_value(&[]);
        assert!(err < 1e-4, "heun {heun}: max error {err}");
    }
}

#[test]
fn classifier_free_guidance_extrapolates() {
    let out = values(&guided_velocity(&t(&[3.0]), &t(&[1.0]), 3.5));
    assert_eq!(out, [1.0 + 3.5 * 2.0]);
}

#[test]
fn learning_rate_warms_up_then_decays_by_cosine() {
    let c = OptimizationConfig {
        learning_rate: 1.0,
        min_learning_rate: 0.1,
        warmup_steps: 10,
        ..Default::default()
    };
    assert_abs_diff_eq!(learning_rate(&c, 0, 110), 0.1);
    assert_abs_diff_eq!(learning_rate(&c, 9, 110), 1.0);
    assert_abs_diff_eq!(learning_rate(&c, 10, 110), 1.0);
    assert_abs_diff_eq!(learning_rate(&c, 60, 110), 0.55, epsilon = 1e-12);
    assert_abs_diff_eq!(learning_rate(&c, 110, 110), 0.1, epsilon = 1e-12);
    let flat = OptimizationConfig {
        lr_schedule: LrSchedule::Constant,
        ..c
    };
    assert_eq!(learning_rate(&flat, 100, 110), 1.0);
}

#[test]
fn adamw_first_step_matches_the_closed_form() {
    let c = OptimizationConfig {
        learning_rate: 0.1,
        weight_decay: 0.5,
        epsilon: 1e-8,
        ..Default::default()
    };
    let w = Tensor::from_slice(&[1.0f32, -2.0])
        .view([1, 2])
        .set_requires_grad(true);
    let b = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
    let mut opt = AdamW::new(
        vec![
            ("w".into(), w.shallow_clone()),
            ("b".into(), b.shallow_clone()),
        ],
        &c,
    );
    (w.sum(Kind::Float) * 2.0 - b.sum(Kind::Float) * 4.0).backward();
    opt.step(0.1);
    // Bias-corrected first step moves each weight by lr·sign(g); weights (2-D) also decay by lr·wd.
    let w_after = values(&w);
    assert_abs_diff_eq!(w_after[0], 1.0 * (1.0 - 0.05) - 0.1, epsilon = 1e-6);
    assert_abs_diff_eq!(w_after[1], -2.0 * (1.0 - 0.05) - 0.1, epsilon = 1e-6);
    assert_abs_diff_eq!(values(&b)[0], 3.0 + 0.1, epsilon = 1e-6); // no decay on biases
    assert!(!w.grad().defined() || w.grad().abs().sum(Kind::Float).double_value(&[]) == 0.0);
}

#[test]
fn adamw_follows_the_reference_update_over_several_steps() {
    let c = OptimizationConfig {
        learning_rate: 0.01,
        weight_decay: 0.1,
        beta1: 0.8,
        beta2: 0.9,
        epsilon: 1e-6,
        ..Default::default()
    };
    let w = Tensor::from_slice(&[0.5f32, -1.5, 2.0, 0.25])
        .view([2, 2])
        .set_requires_grad(true);
    let mut opt = AdamW::new(vec![("w".into(), w.shallow_clone())], &c);
    // The update written out in f64, one element at a time (PyTorch's AdamW).
    let mut reference: Vec<f64> = vec![0.5, -1.5, 2.0, 0.25];
    let (mut m, mut v) = (vec![0.0f64; 4], vec![0.0f64; 4]);
    for t in 1..=4 {
        let scale = [1.0f32, -3.0, 0.5, 2.0][t - 1];
        (w.square().sum(Kind::Float) * scale as f64).backward();
        let grads: Vec<f64> = reference.iter().map(|x| 2.0 * x * scale as f64).collect();
        opt.step(c.learning_rate);
        let (bc1, bc2) = (1.0 - c.beta1.powi(t as i32), 1.0 - c.beta2.powi(t as i32));
        for i in 0..4 {
            reference[i] *= 1.0 - c.learning_rate * c.weight_decay;
            m[i] = c.beta1 * m[i] + (1.0 - c.beta1) * grads[i];
            v[i] = c.beta2 * v[i] + (1.0 - c.beta2) * grads[i] * grads[i];
            let denom = v[i].sqrt() / bc2.sqrt() + c.epsilon;
            reference[i] -= c.learning_rate / bc1 * m[i] / denom;
        }
        for (got, want) in values(&w).iter().zip(&reference) {
            assert_abs_diff_eq!(*got, *want, epsilon = 1e-5);
        }
    }
}
