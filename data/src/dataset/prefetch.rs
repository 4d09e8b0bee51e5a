//! A background thread that reads the next micro-batches while the current one trains, through a
//! bounded queue (at most `depth` micro-batches in memory ahead of training), and prepares
//! whatever else a micro-batch needs (the training loop's tensors and noise), so that the step
//! does not wait for it.

use std::sync::mpsc::{sync_channel, Receiver};
use std::thread::JoinHandle;

use crate::dataset::layout::ShardLayout;
use crate::dataset::order::SampleOrder;
use crate::dataset::reader::LatentDataset;
use crate::dataset::writer::Sample;
use crate::error::DataError;

/// One micro-batch as read: its global sample counters and their samples, and what the thread
/// prepared for it.
#[derive(Debug)]
pub struct Fetched<P = ()> {
    /// Global sample counters (keys of per-sample randomness).
    pub counters: Vec<u64>,
    /// The samples, in counter order.
    pub samples: Vec<Sample>,
    /// Their layout (one resolution bucket).
    pub layout: ShardLayout,
    /// What [`Prefetcher::spawn_preparing`]'s `prepare` made of the micro-batch.
    pub prepared: P,
}

/// Read the samples of `counters` from `dataset` in `order`; all must be of one bucket.
fn fetch(
    dataset: &LatentDataset,
    order: &mut SampleOrder,
    counters: Vec<u64>,
) -> Result<Fetched, DataError> {
    let indices: Vec<u64> = counters.iter().map(|&c| order.index(c)).collect();
    let layout = dataset.layout_of(indices[0]).clone();
    if let Some(&other) = indices
        .iter()
        .find(|&&i| dataset.layout_of(i).latent != layout.latent)
    {
        return Err(DataError::Format {
            path: "latent dataset".into(),
            message: format!(
                "a micro-batch mixes resolution buckets {:?} and {:?} (samples {} and {other})",
                layout.bucket(),
                dataset.layout_of(other).bucket(),
                indices[0]
            ),
        });
    }
    let samples = indices
        .iter()
        .map(|&i| dataset.read(i))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Fetched {
        counters,
        samples,
        layout,
        prepared: (),
    })
}

/// Reads micro-batches ahead on a thread; dropping it stops the thread.
pub struct Prefetcher<P = ()> {
    rx: Option<Receiver<Result<Fetched<P>, DataError>>>,
    thread: Option<JoinHandle<()>>,
}

impl Prefetcher {
    /// Read the micro-batches `batches` (non-empty lists of global counters) of `dataset` in
    /// `order`, up to `depth` (≥ 1) ahead of the consumer. A read error, or a micro-batch whose
    /// samples are of different resolution buckets, is delivered in place of its batch and ends
    /// the thread.
    pub fn spawn(
        dataset: LatentDataset,
        order: SampleOrder,
        batches: impl Iterator<Item = Vec<u64>> + Send + 'static,
        depth: usize,
    ) -> Self {
        Self::spawn_preparing(dataset, order, batches, depth, |_| ())
    }
}

impl<P: Send + 'static> Prefetcher<P> {
    /// As [`Prefetcher::spawn`], and the thread also runs `prepare` on each micro-batch it
    /// read, delivering the result with it ([`Fetched::prepared`]).
    pub fn spawn_preparing(
        dataset: LatentDataset,
        mut order: SampleOrder,
        batches: impl Iterator<Item = Vec<u64>> + Send + 'static,
        depth: usize,
        prepare: impl Fn(&Fetched) -> P + Send + 'static,
    ) -> Self {
        let (tx, rx) = sync_channel(depth.max(1));
        let thread = std::thread::Builder::new()
            .name("flux-prefetch".into())
            .spawn(move || {
                for counters in batches {
                    let item = fetch(&dataset, &mut order, counters).map(|f| Fetched {
                        prepared: prepare(&f),
                        counters: f.counters,
                        samples: f.samples,
                        layout: f.layout,
                    });
                    let failed = item.is_err();
                    if tx.send(item).is_err() || failed {
                        return;
                    }
                }
            })
            .expect("the OS can start a thread");
        Self {
            rx: Some(rx),
            thread: Some(thread),
        }
    }

    /// The next micro-batch, waiting for it if the thread is behind.
    pub fn next_batch(&mut self) -> Result<Fetched<P>, DataError> {
        self.rx
            .as_ref()
            .expect("present until drop")
            .recv()
            .unwrap_or_else(|_| {
                Err(DataError::Format {
                    path: "prefetch thread".into(),
                    message: "stopped after an earlier read error".into(),
                })
            })
    }
}

impl<P> Drop for Prefetcher<P> {
    fn drop(&mut self) {
        // Disconnect first so a thread blocked on a full queue wakes up and exits.
        drop(self.rx.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
