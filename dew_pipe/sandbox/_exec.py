"""The sandbox supervisor: one small process between the launcher and a program.

`launch.py` starts it as ``python -I -S _exec.py CONFIG`` (by path, a few built-in modules
only, so it starts fast, and no ``preexec_fn`` runs in the threaded parent; CONFIG is a dict
in ``marshal`` form, hex-encoded, as ``json`` would cost an import of ``re``). It

1. makes itself a *child subreaper* (``PR_SET_CHILD_SUBREAPER``): every process of the program
   that is orphaned — a daemonized grandchild, a ``setsid`` escapee whose parent exited — is
   re-parented to it instead of to init, so it can find and kill them all;
2. asks for SIGHUP when the launcher dies (``PR_SET_PDEATHSIG``). Linux sends that signal
   when the launching *thread* ends, so on SIGHUP it checks whether its parent process is
   still the launcher (only a thread ended: re-arm and go on) or not (the launcher died:
   kill everything and exit);
3. with a job uid, first kills whatever still runs under it (the uid is leased to this run,
   so such a process can only be a leftover of a supervisor that was itself SIGKILLed);
   then forks the program: a new session, RLIMIT_CPU, RLIMIT_AS, RLIMIT_CORE 0, RLIMIT_NPROC, an
   unprivileged uid/gid when one is configured (root is not bound by RLIMIT_NPROC), SIGKILL
   when the supervisor dies, the working directory, then ``execve`` (looking
   ``argv[0]`` up on the given PATH) with the given environment only. A failure before the exec is reported as a setup error; a command that
   cannot be executed exits 127 with a message on stderr, as a shell would;
4. waits for the program (reaping adopted orphans meanwhile); on SIGTERM from the launcher
   (deadline, excess output, close) or once the program exits, it kills every process left:
   all processes of the job's uid at once (a helper with that uid calls ``kill(-1,
   SIGKILL)``, atomic against concurrent forks), then, round after round, the program's
   process group and every process of the tree below the supervisor, reaping until it has
   no child left — so nothing of the program outlives the supervisor;
5. when the launcher died and the working directory was handed over (``owns_cwd``), removes
   it, as nobody else is left to;
6. writes a last line to the status descriptor, the ``repr`` of a dict (exit code or
   signal, CPU seconds, whether it was stopped, a setup error; the first line,
   ``started PID``, named the program's pid) and exits.

The supervisor's own stdin/stdout/stderr are the program's pipes; it hands them to the
program and points its own at /dev/null, so the launcher sees end-of-file exactly when the
last process holding them is gone.
"""

# The C module under `signal`: the same functions and numbers, without importing enum
# (a few milliseconds of every program's start).
import _signal as signal
import ctypes
import marshal
import os
import resource
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(option, value):
    if _libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl({option}): {os.strerror(error)}")


class _Stop(Exception):
    """Raised by the signal handlers: stop the program and sweep."""


def _tasks_of(uid):
    """Threads of ``uid`` now running: what RLIMIT_NPROC counts for an unchanged uid."""
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/stat", "rb") as handle:
                total += int(handle.read().rsplit(b")", 1)[1].split()[17])
        except (OSError, IndexError, ValueError):
            continue
    return total


def _exec(argv, env):
    """``execve`` with ``argv[0]`` looked up on ``env``'s PATH; returns only on failure.

    Written out rather than ``os.execvpe``, which imports modules: after the uid change the
    interpreter's own library may be unreadable (a Python under /root).
    """
    name = argv[0]
    if "/" in name:
        candidates = [name]
    else:
        candidates = [f"{folder or '.'}/{name}" for folder in env.get("PATH", "").split(":")]
    error = FileNotFoundError(2, "No such file or directory")
    for path in candidates:
        try:
            os.execve(path, argv, env)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as exc:
            error = exc
    return error


def _child(config, err_w):
    """In the forked child: set up, then exec the program. Never returns."""
    try:
        try:
            # Python ignores SIGPIPE and SIGXFSZ, and an ignored signal stays ignored across
            # exec: give the program the defaults a shell would (`yes | head` just ends).
            for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(number, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, [])
            os.setsid()
            soft, hard = config["cpu"]
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
            resource.setrlimit(resource.RLIMIT_AS, (config["memory"], config["memory"]))
            uid = config["uid"]
            if uid is not None:
                os.setgroups([])
                os.setgid(config["gid"])
                os.setuid(uid)
                processes = config["processes"]
            else:  # RLIMIT_NPROC counts all of this uid's tasks, this one included
                processes = _tasks_of(os.getuid()) - 1 + config["processes"]
            resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
            supervisor = os.getppid()
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
            if os.getppid() != supervisor:
                os._exit(126)
            os.chdir(config["cwd"])
        except BaseException as exc:  # noqa: BLE001 - reported to the supervisor
            os.write(err_w, f"{type(exc).__name__}: {exc}".encode())
            os._exit(126)
        argv = config["argv"]
        error = _exec(argv, config["env"])
        os.write(2, f"sandbox: cannot execute {argv[0]!r}: {error.strerror}\n".encode())
    finally:
        os._exit(127)  # whatever happened, the child never returns into the supervisor


def _descendants():
    """Pids below this process, parents before their children (one scan of /proc)."""
    children = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as handle:
                    parent = int(handle.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(name))
    found, frontier = [], [os.getpid()]
    while frontier:
        below = children.get(frontier.pop(), [])
        found += below
        frontier += below
    return found


def _kill_uid(uid):
    """SIGKILL every process of ``uid`` at once, from a helper that has that uid."""
    helper = os.fork()
    if helper == 0:
        try:
            os.setgroups([])
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)  # everything this uid may signal: the job's processes
        except BaseException:  # noqa: BLE001
            os._exit(1)
        os._exit(0)
    os.waitpid(helper, 0)


def _sweep(uid, group):
    """Kill and reap every descendant; returns when this process has no children left.

    Each round kills the program's process group and then every process of the tree below
    (killing one level at a time would let a fork bomb's deeper levels refill the slots it
    frees), then reaps; orphans come back to this subreaper for the next round.
    """
    if uid is not None:
        _kill_uid(uid)
    while True:
        if group is not None:
            try:  # noqa: SIM105 - contextlib costs this short-lived process an import
                os.killpg(group, signal.SIGKILL)  # atomic against forks inside the group
            except OSError:
                pass  # the group is gone (its pid cannot be reused while the group lives)
        found = _descendants()
        for pid in found:
            try:  # noqa: SIM105
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            pid, _ = os.waitpid(-1, 0 if found else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:  # children exist that /proc did not list yet
            os.sched_yield()


def _launcher_gone(parent, status_fd, grace_ms):
    """Whether the launcher died (or is dying), so the working directory is ours to remove.

    Reparenting is the last step of a process's exit. A launcher killed with SIGKILL closes
    its files first, one by one, so the program can see end-of-file on its stdin and exit
    while the launcher is still this process's parent and may still hold the status pipe's
    reading end. Once that end is closed too, poll reports POLLERR on the writing end; this
    waits up to ``grace_ms`` for it (0 when the launcher asked for the stop itself).
    """
    if os.getppid() != parent:
        return True
    import select  # only here: every program's start would pay for the import

    poller = select.poll()
    poller.register(status_fd, 0)  # POLLERR, no reader left, is reported whatever the mask
    return bool(poller.poll(grace_ms)) or os.getppid() != parent


def main(argv):
    config = marshal.loads(bytes.fromhex(argv[1]))
    status_fd = config["status_fd"]
    parent = config["parent"]
    os.set_inheritable(status_fd, False)
    report = {"exit": None, "signal": None, "cpu": 0.0, "stopped": False, "error": None}
    child = None

    def on_term(signum, frame):
        raise _Stop

    def on_hup(signum, frame):
        if os.getppid() == parent:  # only the launching thread ended; the launcher lives
            _prctl(PR_SET_PDEATHSIG, signal.SIGHUP)
            if os.getppid() == parent:
                return
        raise _Stop

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_hup)
    try:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGHUP)
        if os.getppid() != parent:
            raise _Stop
        if config["uid"] is not None:  # the uid is leased to this run: anything of it is stale
            _kill_uid(config["uid"])
        err_r, err_w = os.pipe()
        # A stop request must not reach the child before it drops these handlers.
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM, signal.SIGHUP])
        child = os.fork()
        if child == 0:
            os.close(err_r)
            _child(config, err_w)
        os.write(status_fd, f"started {child}\n".encode())
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM, signal.SIGHUP])
        os.close(err_w)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        failure = b""
        while chunk := os.read(err_r, 4096):  # empty at the exec (close-on-exec) or exit
            failure += chunk
        os.close(err_r)
        if failure:
            report["error"] = failure.decode(errors="replace")
        while True:
            pid, status, usage = os.wait4(-1, 0)
            if pid == child:
                report["cpu"] = usage.ru_utime + usage.ru_stime
                if os.WIFSIGNALED(status):
                    report["signal"] = os.WTERMSIG(status)
                else:
                    report["exit"] = os.waitstatus_to_exitcode(status)
                break
    except _Stop:
        report["stopped"] = True
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher
        report["error"] = f"supervisor: {type(exc).__name__}: {exc}"
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM, signal.SIGHUP])
        _sweep(config["uid"], child)
    if config["owns_cwd"] and _launcher_gone(parent, status_fd, 0 if report["stopped"] else 500):
        import shutil  # only now: every program's start would pay for the import

        shutil.rmtree(config["cwd"], ignore_errors=True)
    os.write(status_fd, f"{report!r}\n".encode())
    os.close(status_fd)


if __name__ == "__main__":
    main(sys.argv)
