"""The file system a checkpoint goes to: its device and free space, for the messages of a failed save."""
import os

# What torch.save / DeepSpeed say when a write fails on a full disk (they drop the errno)
FULL_DISK_TEXTS = ("no space left", "iostream error", "file write failed", "disk quota exceeded")


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3g} GB"


def looks_full(text: str) -> bool:
    return any(t in text.lower() for t in FULL_DISK_TEXTS)


def device_of(path: str) -> str:
    """'DEVICE (mount point)' of the file system holding `path`, from /proc/mounts (Linux)."""
    path = os.path.realpath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    best = ("unknown device", "/")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, mount = line.split()[:2]
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best[1]):
                    best = (device, mount)
    except OSError:
        return f"the file system of {path}"
    return f"{best[0]} ({best[1]})"


def fsync_write(path: str, data: str | bytes) -> None:
    """Write `path` and flush it to the disk before returning (a checkpoint's small files)."""
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
