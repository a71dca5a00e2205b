"""The engines' seccomp policy: a default-deny allowlist of system calls, built with libseccomp.

An inference engine (Python, PyTorch, SGLang, the vendor runtimes behind them, the test engine) needs
files, memory, threads and processes, signals, clocks, sockets, polling and `ioctl` (accelerator
drivers speak through it). Everything else is refused:

* calls outside the allowlist fail with EPERM (the engine sees an ordinary error and carries on);
* the calls that only serve to escape or attack the host (mount and the new mount API, ptrace,
  kexec, bpf, kernel modules, reboot, swap) kill the whole engine process with SIGSYS;
* `clone` is allowed only without namespace flags (a new user namespace is the usual first step of a
  kernel exploit); `clone3`, whose flags a filter cannot read, answers ENOSYS so the C library falls
  back to `clone`;
* calls of a foreign ABI (32-bit calls on a 64-bit host) kill the process (libseccomp's bad-arch
  action), so the filter cannot be bypassed through another system-call table.

Names unknown to the installed libseccomp (calls newer than it) are left out, which refuses them.
The binding is `pyseccomp` (ctypes over the system's libseccomp.so.2); it is imported only when a
filter is built, so the rest of the agent runs on a host without libseccomp (the sandbox then reports
seccomp as unavailable).
"""

from __future__ import annotations

import errno
from typing import Any

# Files and directories.
_FILES = """
read write readv writev pread64 pwrite64 preadv pwritev preadv2 pwritev2 open openat openat2 creat
close close_range lseek _llseek dup dup2 dup3 fcntl fcntl64 flock fsync fdatasync sync_file_range
syncfs sync ftruncate ftruncate64 truncate truncate64 fallocate fadvise64 fadvise64_64 readahead
stat fstat lstat newfstatat fstatat64 stat64 fstat64 lstat64 statx statfs fstatfs statfs64 fstatfs64
access faccessat faccessat2 getdents getdents64 readlink readlinkat getcwd chdir fchdir mkdir mkdirat
rmdir unlink unlinkat rename renameat renameat2 link linkat symlink symlinkat chmod fchmod fchmodat
fchmodat2 chown fchown lchown fchownat umask utime utimes utimensat futimesat mknod mknodat sendfile
sendfile64 splice tee vmsplice copy_file_range getxattr lgetxattr fgetxattr listxattr llistxattr
flistxattr setxattr lsetxattr fsetxattr removexattr lremovexattr fremovexattr inotify_init
inotify_init1 inotify_add_watch inotify_rm_watch memfd_create ioctl pipe pipe2 eventfd eventfd2
signalfd signalfd4 timerfd_create timerfd_settime timerfd_gettime epoll_create epoll_create1
epoll_ctl epoll_wait epoll_pwait epoll_pwait2 poll ppoll select _newselect pselect6 io_setup
io_destroy io_submit io_getevents io_pgetevents io_cancel
"""
# Memory, shared memory and IPC.
_MEMORY = """
brk mmap mmap2 munmap mremap mprotect madvise mlock mlock2 munlock mlockall munlockall msync mincore
get_mempolicy set_mempolicy mbind move_pages membarrier pkey_alloc pkey_free pkey_mprotect
remap_file_pages shmget shmat shmdt shmctl semget semop semtimedop semctl msgget msgsnd msgrcv msgctl
mq_open mq_unlink mq_timedsend mq_timedreceive mq_notify mq_getsetattr
"""
# Processes, threads, identity, scheduling, signals, clocks.
_PROCESSES = """
fork vfork execve execveat exit exit_group wait4 waitid waitpid kill tkill tgkill rt_sigqueueinfo
rt_tgsigqueueinfo getpid getppid gettid getpgid setpgid getpgrp getsid setsid getuid geteuid getgid
getegid getresuid getresgid getgroups setuid setgid setreuid setregid setresuid setresgid setfsuid
setfsgid setgroups getrlimit setrlimit prlimit64 ugetrlimit getrusage times getpriority setpriority
sched_yield sched_getaffinity sched_setaffinity sched_getparam sched_setparam sched_getscheduler
sched_setscheduler sched_get_priority_max sched_get_priority_min sched_rr_get_interval sched_getattr
sched_setattr set_tid_address set_robust_list get_robust_list futex futex_time64 futex_waitv rseq
arch_prctl prctl capget capset uname sysinfo getrandom personality restart_syscall rt_sigaction
rt_sigprocmask rt_sigreturn rt_sigpending rt_sigsuspend rt_sigtimedwait sigaltstack sigreturn pause
alarm nanosleep clock_nanosleep clock_gettime clock_getres gettimeofday time getitimer setitimer
timer_create timer_settime timer_gettime timer_getoverrun timer_delete ioprio_get ioprio_set getcpu
pidfd_open pidfd_send_signal seccomp
"""
# Sockets.
_NETWORK = """
socket socketpair bind listen accept accept4 connect getsockname getpeername sendto recvfrom sendmsg
recvmsg sendmmsg recvmmsg shutdown setsockopt getsockopt
"""
ALLOWED: tuple[str, ...] = tuple(dict.fromkeys((_FILES + _MEMORY + _PROCESSES + _NETWORK).split()))
"""System calls an engine may make (`clone` is added with its namespace-flag condition)."""

KILLED: tuple[str, ...] = tuple(
    """
    ptrace process_vm_readv process_vm_writev mount umount umount2 pivot_root fsopen fsconfig fsmount
    fspick move_mount open_tree mount_setattr kexec_load kexec_file_load bpf init_module finit_module
    delete_module create_module reboot swapon swapoff
    """.split()
)
"""System calls that kill the engine process (SIGSYS): only useful to escape or attack the host."""

NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
"""CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET."""


def available() -> str | None:
    """None when a filter can be built here, else why not (no binding, no libseccomp.so.2)."""
    try:
        import pyseccomp

        pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    except (ImportError, RuntimeError, OSError) as exc:
        return f"seccomp unavailable: {exc} (install the system's libseccomp2 and the pyseccomp package)"
    return None


def build_filter() -> Any:
    """The engine filter (a `pyseccomp.SyscallFilter`, not loaded); raises OSError/RuntimeError."""
    import pyseccomp

    flt = pyseccomp.SyscallFilter(pyseccomp.ERRNO(errno.EPERM))
    skipped: list[str] = []

    def add(action: int, name: str, *args: Any) -> None:
        try:
            flt.add_rule(action, name, *args)
        except (OSError, RuntimeError, ValueError):
            skipped.append(name)  # unknown to this libseccomp: refused by the default action

    for name in ALLOWED:
        add(pyseccomp.ALLOW, name)
    add(pyseccomp.ALLOW, "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, NAMESPACE_FLAGS, 0))
    add(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    for name in KILLED:
        add(pyseccomp.KILL_PROCESS, name)
    return flt
