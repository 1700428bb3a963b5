//! Handing things to the tasks of one thread with one wake-up: the outcomes of a batched
//! script call (see [`super::batch`]) go to requests waiting on every worker.
//!
//! The call's answer is read on one worker, and the requests that waited for it sit on
//! all of them. Waking a task that belongs to another worker's runtime costs that
//! runtime a wake-up of its own (an eventfd write, then an epoll return) per task. A
//! [`Mailbox`] belongs to one thread: whatever a batch brings for that thread is posted
//! at once, with one wake-up, and the mailbox's own task on that thread hands each item
//! on, so the requests' wakes stay on their thread.
//!
//! A mailbox closes when its runtime drops its task (shutdown, or a test's runtime
//! ending): what was posted is handed on then, and later posts are refused, so the
//! poster hands its items on itself. Nothing posted is ever lost.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

/// Items waiting for one thread's task, and the wake-up that calls it.
pub(super) struct Mailbox<T> {
    items: Mutex<Vec<T>>,
    posted: Notify,
    open: AtomicBool,
}

impl<T: Send + 'static> Mailbox<T> {
    /// A mailbox whose task, spawned on the current runtime (so on this thread, for a
    /// worker's single-threaded runtime), hands every posted item to `deliver`. `None`
    /// outside a runtime.
    pub(super) fn open(deliver: fn(T)) -> Option<Arc<Mailbox<T>>> {
        let rt = tokio::runtime::Handle::try_current().ok()?;
        let mailbox = Arc::new(Mailbox {
            items: Mutex::new(Vec::new()),
            posted: Notify::new(),
            open: AtomicBool::new(true),
        });
        let task = Arc::clone(&mailbox);
        rt.spawn(async move {
            let on_close = Closing {
                mailbox: &task,
                deliver,
            };
            loop {
                on_close.mailbox.posted.notified().await;
                let items = std::mem::take(&mut *on_close.mailbox.lock());
                items.into_iter().for_each(deliver);
            }
        });
        Some(mailbox)
    }

    /// Whether posts are still taken (its task is alive).
    pub(super) fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    /// Posts `items` with one wake-up of the mailbox's task; hands them back when the
    /// mailbox has closed.
    pub(super) fn post(&self, mut items: Vec<T>) -> Result<(), Vec<T>> {
        {
            let mut queued = self.lock();
            // Read under the lock `Closing` takes: once it has emptied the mailbox, no
            // post can land after it.
            if !self.is_open() {
                return Err(items);
            }
            queued.append(&mut items);
        }
        self.posted.notify_one();
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, Vec<T>> {
        self.items.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Closes the mailbox when its task is dropped, handing on what was posted.
struct Closing<'a, T> {
    mailbox: &'a Mailbox<T>,
    deliver: fn(T),
}

impl<T> Drop for Closing<'_, T> {
    fn drop(&mut self) {
        let left = {
            let mut queued = self.mailbox.items.lock().unwrap_or_else(|e| e.into_inner());
            self.mailbox.open.store(false, Ordering::Release);
            std::mem::take(&mut *queued)
        };
        left.into_iter().for_each(self.deliver);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    static DELIVERED: AtomicUsize = AtomicUsize::new(0);

    fn count(n: usize) {
        DELIVERED.fetch_add(n, Ordering::SeqCst);
    }

    /// Items posted from another thread are handed on by the mailbox's task on its
    /// runtime; after the runtime ends, posts are refused and nothing is lost.
    #[test]
    fn posts_reach_the_mailboxs_runtime_and_none_are_lost_after_it_ends() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mailbox = rt.block_on(async { Mailbox::open(count).unwrap() });
        let remote = Arc::clone(&mailbox);
        std::thread::spawn(move || remote.post(vec![1, 2, 3]).map_err(|_| ()))
            .join()
            .unwrap()
            .expect("open while its runtime lives");
        rt.block_on(async {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while DELIVERED.load(Ordering::SeqCst) < 6 {
                assert!(tokio::time::Instant::now() < deadline, "never delivered");
                tokio::task::yield_now().await;
            }
        });
        assert!(mailbox.is_open());
        // Posted but not yet handed on when the runtime ends: handed on at its end.
        mailbox.post(vec![10]).map_err(|_| ()).unwrap();
        drop(rt);
        assert_eq!(DELIVERED.load(Ordering::SeqCst), 16);
        assert!(!mailbox.is_open());
        assert_eq!(
            mailbox.post(vec![100]),
            Err(vec![100]),
            "refused, given back"
        );
        assert!(Mailbox::<usize>::open(count).is_none(), "no runtime here");
    }
}
