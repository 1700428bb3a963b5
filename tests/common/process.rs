//! Child processes that die with the test: every process a test starts is held by a
//! [`ChildGuard`], which kills and reaps it when dropped — also when the test panics.

use std::io::Read;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// A child process killed (SIGKILL) and waited for on drop, unless it already exited.
pub struct ChildGuard {
    child: Child,
}

impl ChildGuard {
    /// Spawns `cmd` under a guard; panics naming the program when it cannot start.
    pub fn spawn(cmd: &mut Command) -> ChildGuard {
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {:?}: {e}", cmd.get_program()));
        ChildGuard { child }
    }

    /// The child's pid.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// The child itself (to take its pipes or poll it).
    pub fn child(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Waits for the child to exit on its own, at most `deadline` (then it is killed and
    /// the test fails).
    pub fn wait_within(&mut self, deadline: Duration) -> ExitStatus {
        let end = Instant::now() + deadline;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                Instant::now() < end,
                "child {} still running after {deadline:?}",
                self.child.id()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Kills the child now and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl From<Child> for ChildGuard {
    fn from(child: Child) -> ChildGuard {
        ChildGuard { child }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill();
        }
    }
}

/// Runs `cmd` to completion like [`Command::output`], but under a guard and a deadline:
/// a child still running after `deadline` is killed and the test fails.
pub fn output_within(cmd: &mut Command, deadline: Duration) -> Output {
    output_with_stdin(cmd, None, deadline)
}

/// [`output_within`], writing `input` to the child's stdin first (then closing it).
pub fn output_with_stdin(cmd: &mut Command, input: Option<&[u8]>, deadline: Duration) -> Output {
    cmd.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut guard = ChildGuard::spawn(cmd);
    if let (Some(input), Some(mut stdin)) = (input, guard.child().stdin.take()) {
        use std::io::Write;
        stdin.write_all(input).expect("write to the child's stdin");
        // Dropped here: the child sees end of input.
    }
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = drain(guard.child().stdout.take().map(|s| Box::new(s) as _));
    let err = drain(guard.child().stderr.take().map(|s| Box::new(s) as _));
    let status = guard.wait_within(deadline);
    Output {
        status,
        stdout: out.join().expect("stdout reader"),
        stderr: err.join().expect("stderr reader"),
    }
}

/// [`output_within`] as a method, in place of [`Command::output`].
pub trait RunWithin {
    /// Runs to completion under a guard; killed and failing the test after `deadline`.
    fn run_within(&mut self, deadline: Duration) -> Output;
}

impl RunWithin for Command {
    fn run_within(&mut self, deadline: Duration) -> Output {
        output_within(self, deadline)
    }
}

/// A long-running child (`sluice run`) whose stderr is collected as it comes, so a test
/// can wait for a log line with a deadline; killed on drop like any [`ChildGuard`].
pub struct LoggedChild {
    /// The child, killed and reaped on drop.
    pub guard: ChildGuard,
    log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl LoggedChild {
    /// Spawns `cmd` with stderr piped (stdin and stdout closed).
    pub fn spawn(cmd: &mut Command) -> LoggedChild {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut guard = ChildGuard::spawn(cmd);
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let mut stderr = guard.child().stderr.take().expect("piped stderr");
        let sink = std::sync::Arc::clone(&log);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stderr.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let text = String::from_utf8_lossy(&buf[..n]);
                sink.lock().unwrap().push_str(&text);
            }
        });
        LoggedChild { guard, log }
    }

    /// Everything the child wrote to stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Waits until the log contains `needle`; fails after `deadline`, or when the child
    /// exits first, showing the log.
    pub fn wait_log(&mut self, needle: &str, deadline: Duration) {
        let end = Instant::now() + deadline;
        while !self.log().contains(needle) {
            let exited = self.guard.child().try_wait().ok().flatten();
            assert!(
                exited.is_none() && Instant::now() < end,
                "no {needle:?} in the log within {deadline:?} (exit: {exited:?}):\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
