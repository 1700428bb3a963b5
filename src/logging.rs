//! Where log lines go. A line (the decision log's and every other) is formatted on the
//! thread that logs it and queued for a background writer thread (`sluice-log`), which
//! writes the queue out in batches to stderr or to `[log] file`. The queue is bounded
//! (`[log] buffer_lines`): when the writer falls behind (a slow disk, a pipe nobody
//! reads), new lines are dropped and counted in `sluice_log_dropped_total`, so no
//! request ever waits for the log.
//!
//! The queue and the writer thread are `tracing-appender`'s lossy non-blocking writer;
//! its writer is buffered here, so the thread makes one `write(2)` per batch of lines
//! rather than one per line.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::sync::OnceLock;

use tracing_appender::non_blocking::{ErrorCounter, NonBlockingBuilder};
pub use tracing_appender::non_blocking::{NonBlocking, WorkerGuard};

/// The writer's buffer: lines are written out when it fills or the queue is empty.
const WRITE_BUFFER: usize = 64 * 1024;

/// The dropped-line count of the process's writer, once [`writer`] made it.
static DROPPED: OnceLock<ErrorCounter> = OnceLock::new();

/// Lines the queue was full for since start (`sluice_log_dropped_total`).
pub fn dropped() -> u64 {
    DROPPED.get().map_or(0, |c| c.dropped_lines() as u64)
}

/// Opens `[log] file` for appending, creating it when missing.
pub fn open(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
}

/// The non-blocking writer over `file` (stderr when `None`), queueing at most `lines`
/// lines, and the guard that flushes what is queued when dropped (keep it until exit).
/// The first writer made in a process is the one `sluice_log_dropped_total` counts.
pub fn writer(file: Option<File>, lines: usize) -> (NonBlocking, WorkerGuard) {
    let out: Box<dyn Write + Send> = match file {
        Some(f) => Box::new(f),
        None => Box::new(io::stderr()),
    };
    let (writer, guard) = NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(lines.max(1))
        .thread_name("sluice-log")
        .finish(BufWriter::with_capacity(WRITE_BUFFER, out));
    let _ = DROPPED.set(writer.error_counter());
    (writer, guard)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_queue_drops_and_counts_instead_of_waiting() {
        /// A sink that never returns: the writer thread is stuck on its first write.
        struct Stuck;
        impl Write for Stuck {
            fn write(&mut self, _: &[u8]) -> io::Result<usize> {
                loop {
                    std::thread::park();
                }
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let (mut w, guard) = NonBlockingBuilder::default()
            .lossy(true)
            .buffered_lines_limit(4)
            .finish(Stuck);
        let counter = w.error_counter();
        let started = std::time::Instant::now();
        for _ in 0..1000 {
            w.write_all(b"a line\n").unwrap();
        }
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        // At most the one being written and the four queued got through.
        assert!(
            counter.dropped_lines() >= 995,
            "{}",
            counter.dropped_lines()
        );
        // The guard gives up on a stuck writer after its timeout instead of hanging.
        std::mem::forget(guard);
    }
}
