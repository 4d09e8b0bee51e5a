//! Ranks as threads of one process: a real group for tensor-parallel tests without MPI.

use std::sync::{Arc, Barrier, Mutex};

use flux_model::tp::Collective;
use tch::Tensor;

/// Ranks in threads of one process, summing and gathering through shared memory.
pub struct ThreadGroup {
    rank: usize,
    shared: Arc<(Mutex<Vec<Vec<f32>>>, Barrier)>,
}

impl ThreadGroup {
    /// The `size` members of a new group, rank order.
    pub fn group(size: usize) -> Vec<Self> {
        let shared = Arc::new((Mutex::new(vec![Vec::new(); size]), Barrier::new(size)));
        (0..size)
            .map(|rank| Self {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    /// Every rank's `data`, in rank order.
    fn exchange(&self, data: &[f32]) -> Vec<Vec<f32>> {
        let (slots, barrier) = &*self.shared;
        slots.lock().unwrap()[self.rank] = data.to_vec();
        barrier.wait();
        let all = slots.lock().unwrap().clone();
        barrier.wait();
        all
    }
}

impl Collective for ThreadGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.0.lock().unwrap().len()
    }

    fn all_reduce_sum(&self, data: &mut [f32]) {
        let all = self.exchange(data);
        for (i, v) in data.iter_mut().enumerate() {
            *v = all.iter().map(|r| r[i]).sum();
        }
    }

    fn all_gather(&self, data: &[f32], out: &mut [f32]) {
        out.copy_from_slice(&self.exchange(data).concat());
    }

    fn reduce_scatter_sum(&self, data: &[f32], out: &mut [f32]) {
        let all = self.exchange(data);
        let at = self.rank * out.len();
        for (i, v) in out.iter_mut().enumerate() {
            *v = all.iter().map(|r| r[at + i]).sum();
        }
    }
}

/// Assert that rank `rank`'s gathered gradients `got` equal the one-process `expected` (same
/// names, same order) to `tolerance` of each gradient's largest entry, and that none is zero.
pub fn assert_grads_match(
    rank: usize,
    expected: &[(String, Tensor)],
    got: &[(String, Tensor)],
    tolerance: f64,
) {
    assert_eq!(expected.len(), got.len());
    for ((name, g1), (_, g2)) in expected.iter().zip(got) {
        let scale = g1.abs().max().double_value(&[]);
        assert!(scale > 0.0, "`{name}` has no gradient");
        let dg = (g1 - g2).abs().max().double_value(&[]) / scale;
        assert!(
            dg <= tolerance,
            "rank {rank}: `{name}` gradient max|Δ|/max|g| {dg:e}"
        );
    }
}
