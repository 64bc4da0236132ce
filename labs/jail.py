"""The first process of every criterion's child: it limits itself, then becomes the command.

    python -m labs.jail CONFIG_JSON -- COMMAND [ARG ...]

labs/sandbox.py starts it in a session and process group of its own; it then, in order:
  1. as root, with "uid" in CONFIG: enters new mount and network namespaces (the network has
     only a loopback, so ranks can still talk to each other and to nothing else); gives /tmp
     and /dev/shm fresh size-capped file systems, so nothing written there outlives the
     child; binds the scratch folder back in; lays a read-only view over the repository and
     empties, in that view, the labs' answers (solution.py, reference.py, mutants/); and
     opens the way to the few folders that a directory only root may enter hides (a Python
     under /root, say) by covering that directory with an empty one holding just them;
  2. sets no_new_privs (no set-user-id program can give privileges back) and the resource
     limits: CPU seconds, address space, file size, processes, no core files;
  3. as root: drops every group and becomes CONFIG's unprivileged uid and gid;
  4. enters the scratch folder and execs COMMAND with CONFIG's environment.
Any failure before the exec prints one line, `jail: ...`, and exits 120: the grader reports
that the sandbox could not start, never a student's verdict.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import resource
import socket
import struct
import sys

JAIL_FAILED = 120
CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None):
    enc = (lambda s: s.encode() if s is not None else None)
    _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    _check(_libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {dst}")


def loopback_up():
    """The new network namespace's only interface, lo, brought up (it starts down)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        ifr = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, ifr))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
    finally:
        s.close()


def bind(src: str, dst: str, read_only: bool = False):
    mount(src, dst, None, MS_BIND | MS_REC)
    if read_only:
        mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC)


def make_like(src: str, dst: str):
    """An empty directory or file at dst to bind src onto."""
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()


def namespaces(cfg: dict):
    """Step 1: the child's own view of the file system and its own network. The folders to
    keep are held open (O_PATH) before anything covers them, then bound back from the open
    descriptors."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    keep = sorted({cfg["scratch"], *cfg["keep"], *[n for _, needs in cfg["reveal"] for n in needs]}, key=len)
    held = [(os.open(path, os.O_PATH), path) for path in keep]     # parents first
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={cfg['tmp_bytes']}")
    if os.path.isdir("/dev/shm"):
        mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={cfg['tmp_bytes']}")
    for blocking, _ in cfg["reveal"]:
        mount("tmpfs", blocking, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for fd, path in held:                                  # the scratch, the repository, Python
        src = f"/proc/self/fd/{fd}"
        make_like(src, path)
        bind(src, path)
        os.close(fd)
    for path in cfg["read_only"]:
        bind(path, path, read_only=True)
    for path in cfg.get("hide", []):                       # the answers: an empty file or folder
        if os.path.isdir(path):
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "mode=0755,size=4k")
        elif os.path.exists(path):
            bind("/dev/null", path)
    loopback_up()


def limits(cfg: dict):
    """Step 2: resource limits; each only lowers what the grader itself may use."""
    for name, value in (("RLIMIT_CPU", cfg["cpu_seconds"]), ("RLIMIT_AS", cfg["memory_bytes"]),
                        ("RLIMIT_FSIZE", cfg["file_bytes"]), ("RLIMIT_NPROC", cfg["processes"]),
                        ("RLIMIT_CORE", 0)):
        which = getattr(resource, name)
        soft, hard = resource.getrlimit(which)
        new = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (new, new))


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = json.loads(argv[0])
        command = argv[argv.index("--") + 1:]
        if cfg.get("uid") is not None:
            namespaces(cfg)
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
        limits(cfg)
        if cfg.get("uid") is not None:
            os.setgroups([])
            os.setgid(cfg["gid"])
            os.setuid(cfg["uid"])
            if os.getuid() == 0 or os.geteuid() == 0:
                raise OSError("still root after setuid")
        os.umask(0o077)
        os.chdir(cfg["scratch"])
        os.execve(command[0], command, cfg["env"])
    except Exception as e:                              # noqa: BLE001 - one line, never a traceback
        print(f"jail: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(JAIL_FAILED)


if __name__ == "__main__":
    main()
