//! The threads that serve sender connections (`proxy.workers`): each worker is a
//! single-threaded tokio runtime on its own OS thread, and each accepted connection is
//! handed to one worker (round robin) and served there from start to end — its
//! requests, its own upstream connection and its tunnels.
//!
//! A connection never changes threads, so its tasks wake each other without crossing
//! cores and nothing is stolen between workers: on a few cores this costs a quarter
//! less CPU per request than one work-stealing runtime (docs/BENCHMARKS.md). What all
//! workers share (the bucket store, metrics, configuration) is `Send + Sync` already.
//! The accept loops, the admin listener and background jobs (reload, observer, store
//! heartbeats and connections) stay on the main runtime.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;

use tokio::runtime::Handle;
use tokio::sync::watch;

/// Worker runtimes, running until dropped.
pub struct Workers {
    handles: Vec<Handle>,
    next: AtomicUsize,
    stop: watch::Sender<bool>,
    threads: Vec<JoinHandle<()>>,
}

impl Workers {
    /// Starts `n` workers (`0`: one per available core).
    pub fn start(n: usize) -> std::io::Result<Workers> {
        let n = match n {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let (stop, _) = watch::channel(false);
        let mut handles = Vec::with_capacity(n);
        let mut threads = Vec::with_capacity(n);
        for i in 0..n {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            handles.push(rt.handle().clone());
            let mut stopped = stop.subscribe();
            let thread = std::thread::Builder::new()
                .name(format!("sluice-worker-{i}"))
                .spawn(move || {
                    // Drives the tasks spawned onto this runtime until the pool is dropped.
                    rt.block_on(async move {
                        let _ = stopped.wait_for(|s| *s).await;
                    });
                })?;
            threads.push(thread);
        }
        Ok(Workers {
            handles,
            next: AtomicUsize::new(0),
            stop,
            threads,
        })
    }

    /// How many workers run.
    pub fn len(&self) -> usize {
        self.handles.len()
    }

    /// Always false: a pool has at least one worker.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
    }

    /// The worker the next connection goes to.
    pub fn next(&self) -> &Handle {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.handles.len();
        &self.handles[i]
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stop.send_replace(true);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_are_spread_over_every_worker_and_tasks_run_there() {
        let workers = Workers::start(3).unwrap();
        assert_eq!(workers.len(), 3);
        let names: Vec<String> = (0..6)
            .map(|_| {
                let (tx, rx) = std::sync::mpsc::channel();
                workers.next().spawn(async move {
                    let name = std::thread::current().name().unwrap_or("").to_owned();
                    tx.send(name).unwrap();
                });
                rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap()
            })
            .collect();
        let expected: Vec<String> = (0..6).map(|i| format!("sluice-worker-{}", i % 3)).collect();
        assert_eq!(names, expected);
    }

    #[test]
    fn zero_means_one_per_core() {
        let cores = std::thread::available_parallelism().unwrap().get();
        assert_eq!(Workers::start(0).unwrap().len(), cores);
    }
}
