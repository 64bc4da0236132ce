"""The first process of every criterion's child: it limits itself, then becomes the command.

    python -m labs.jail CONFIG_JSON -- COMMAND [ARG ...]

labs/sandbox.py starts it in a session and process group of its own; it then, in order:
  1. as root, with "uid" in CONFIG: enters new mount and network namespaces (the network has
     only a loopback, so ranks can still talk to each other and to nothing else) and changes
     its root to a new, empty one that holds only what a child needs (namespaces() below):
     the rest of the machine is not there, the repository is read-only with the labs'
     answers (solution.py, reference.py, mutants/) emptied, and /tmp and /dev/shm are fresh
     and size-capped, so nothing written there outlives the child;
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


SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/sys")
DEVICES = ("null", "zero", "full", "random", "urandom")


def place(path: str, root: str) -> str:
    """`path` inside the new root, its parent folders made."""
    inside = root + path
    os.makedirs(os.path.dirname(inside), exist_ok=True)
    return inside


def graft(src: str, root: str, read_only: bool = True):
    """src bound at the same path inside the new root (a link is copied as a link)."""
    at = place(src, root)
    if os.path.islink(src):
        if not os.path.lexists(at):
            os.symlink(os.readlink(src), at)
        return
    if os.path.isdir(src):
        os.makedirs(at, exist_ok=True)
    elif not os.path.exists(at):
        open(at, "a").close()
    bind(src, at, read_only)


def namespaces(cfg: dict):
    """Step 1: the child's own file system and its own network. A new, empty root holds only
    what a child needs, bound at the paths it has outside: the system's programs, libraries
    and settings, Python, the repository (read-only, the labs' answers emptied) and the
    scratch folder (writable); a fresh /tmp, /dev/shm and /dev of the few plain devices, and
    /proc. Everything else on the machine (other checkouts, homes, a teacher's folders) is
    not there at all."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = cfg["root"]
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=16m")
    for path in SYSTEM:
        if os.path.lexists(path):
            graft(path, root)
    for path in ("/tmp", "/dev/shm"):
        os.makedirs(root + path, exist_ok=True)
        mount("tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={cfg['tmp_bytes']}")
    for name in DEVICES:
        graft(f"/dev/{name}", root, read_only=False)
    os.makedirs(root + "/proc", exist_ok=True)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV)
    for path in sorted(set(cfg["keep"]), key=len):         # after /tmp: a checkout may live there
        graft(path, root)
    for path in cfg.get("hide", []):                       # the answers: an empty file or folder
        at = root + path
        if os.path.isdir(at):
            mount("tmpfs", at, "tmpfs", MS_NOSUID | MS_NODEV | MS_RDONLY, "mode=0755,size=4k")
        elif os.path.exists(at):
            bind("/dev/null", at)
    graft(cfg["scratch"], root, read_only=False)
    loopback_up()
    os.chroot(root)
    os.chdir("/")


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
