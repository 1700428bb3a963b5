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
//!
//! One worker per core also means one core per worker (`proxy.pin_workers`): when the
//! process may run on exactly as many CPUs as there are workers, each worker is bound to
//! one of them. Left to the kernel, two workers sometimes share a core while the other
//! runs the rest of the machine, and the requests of both wait for each other's turns
//! (the p99 of docs/BENCHMARKS.md). On a larger CPU set (a shared host, a container with
//! a quota but no cpuset) nothing is bound: a bound worker could not move off a core
//! that something else keeps busy.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;

use core_affinity::CoreId;
use tokio::runtime::Handle;
use tokio::sync::watch;

/// Worker runtimes, running until dropped.
pub struct Workers {
    handles: Vec<Handle>,
    next: AtomicUsize,
    stop: watch::Sender<bool>,
    threads: Vec<JoinHandle<()>>,
    pinned: Option<Vec<usize>>,
}

/// The CPU each worker is bound to: one each, in order, when the process may run on
/// exactly `workers` CPUs (a machine of its own, `taskset`, a container's exclusive
/// cpuset); `None` otherwise.
fn pin_plan(allowed: &[CoreId], workers: usize) -> Option<Vec<CoreId>> {
    (workers > 0 && allowed.len() == workers).then(|| allowed.to_vec())
}

impl Workers {
    /// Starts `n` workers (`0`: one per available core); with `pin`, each is bound to a
    /// CPU of its own when the process may run on exactly `n` CPUs.
    pub fn start(n: usize, pin: bool) -> std::io::Result<Workers> {
        let n = match n {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let plan = if pin {
            core_affinity::get_core_ids().and_then(|allowed| pin_plan(&allowed, n))
        } else {
            None
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
            let core = plan.as_ref().map(|p| p[i]);
            let thread = std::thread::Builder::new()
                .name(format!("sluice-worker-{i}"))
                .spawn(move || {
                    if let Some(core) = core {
                        if !core_affinity::set_for_current(core) {
                            tracing::warn!(
                                worker = i,
                                cpu = core.id,
                                "could not bind the worker to its CPU"
                            );
                        }
                    }
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
            pinned: plan.map(|p| p.iter().map(|c| c.id).collect()),
        })
    }

    /// The CPU each worker is bound to, in worker order (a worker the kernel refused logs a
    /// warning and runs unbound); `None` when they all run where the kernel puts them.
    pub fn pinned(&self) -> Option<&[usize]> {
        self.pinned.as_deref()
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
        let workers = Workers::start(3, false).unwrap();
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
        assert_eq!(Workers::start(0, false).unwrap().len(), cores);
    }

    /// The CPUs each worker may run on, asked from inside the worker.
    fn cpus_of_each(workers: &Workers) -> Vec<Vec<usize>> {
        (0..workers.len())
            .map(|_| {
                let (tx, rx) = std::sync::mpsc::channel();
                workers.next().spawn(async move {
                    let ids = core_affinity::get_core_ids().unwrap_or_default();
                    tx.send(ids.iter().map(|c| c.id).collect::<Vec<_>>())
                        .unwrap();
                });
                rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap()
            })
            .collect()
    }

    fn allowed() -> Vec<usize> {
        let ids = core_affinity::get_core_ids().expect("the CPUs this process may use");
        ids.iter().map(|c| c.id).collect()
    }

    #[test]
    fn one_worker_per_allowed_cpu_binds_each_worker_to_its_own_cpu() {
        let allowed = allowed();
        let workers = Workers::start(allowed.len(), true).unwrap();
        assert_eq!(workers.pinned(), Some(&allowed[..]));
        let each: Vec<Vec<usize>> = allowed.iter().map(|&c| vec![c]).collect();
        assert_eq!(cpus_of_each(&workers), each);
    }

    #[test]
    fn workers_are_left_unbound_when_asked_or_when_they_do_not_match_the_cpus() {
        let allowed = allowed();
        let off = Workers::start(allowed.len(), false).unwrap();
        assert_eq!(off.pinned(), None);
        assert!(cpus_of_each(&off).iter().all(|c| *c == allowed));
        let more = Workers::start(allowed.len() + 1, true).unwrap();
        assert_eq!(more.pinned(), None);
        assert!(cpus_of_each(&more).iter().all(|c| *c == allowed));
    }

    #[test]
    fn the_plan_binds_only_an_exact_match() {
        let cpus: Vec<CoreId> = [2, 3, 5].iter().map(|&id| CoreId { id }).collect();
        let ids = |p: Option<Vec<CoreId>>| p.map(|v| v.iter().map(|c| c.id).collect::<Vec<_>>());
        assert_eq!(ids(pin_plan(&cpus, 3)), Some(vec![2, 3, 5]));
        assert_eq!(ids(pin_plan(&cpus, 2)), None);
        assert_eq!(ids(pin_plan(&cpus, 4)), None);
        assert_eq!(ids(pin_plan(&[], 0)), None);
    }
}
