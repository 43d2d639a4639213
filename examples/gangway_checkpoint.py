"""Gangway's checkpoint handshake for Python ranks (standard library only).

A rank saves a checkpoint into ``$GANGWAY_CHECKPOINT_DIR`` and then announces
it by writing ``LATEST`` there atomically (write a temporary file, then
rename it) with ``{"step": N, "path": "..."}``. The node agent reads
``LATEST`` on every sync and reports it to the server, which

* names it in the job's events ("checkpoint at step 340 (12 s before the
  signal)"),
* counts the work a preemption would lose from it,
* stops a preempted gang as soon as a checkpoint written after the signal is
  reported, instead of waiting out the whole grace period,
* gives the next attempt its path as ``GANGWAY_RESUME_FROM``.

Usage (see examples/ddp_train.py)::

    import gangway_checkpoint as gc

    start = 0
    path = gc.resume_from()
    if path:
        start = load(path)                      # your own loader
    ...
    gc.save(step, lambda tmp: torch.save(state, tmp))   # rank 0 only

See docs/JOB_ENV.md for the whole contract.
"""

import json
import os
import tempfile

LATEST = "LATEST"


def checkpoint_dir():
    """The job's checkpoint directory (``$GANGWAY_CHECKPOINT_DIR``), created if needed."""
    d = os.environ.get("GANGWAY_CHECKPOINT_DIR")
    if not d:
        raise RuntimeError("GANGWAY_CHECKPOINT_DIR is not set: not running under Gangway?")
    os.makedirs(d, exist_ok=True)
    return d


def _atomic_write(path, write):
    """Calls ``write(tmp_path)``, flushes it to disk, then renames it to ``path``."""
    directory = os.path.dirname(path) or "."
    # Not a dot-file: torch.save names its zip archive after the file's stem,
    # which a leading dot leaves empty ("invalid file name").
    fd, tmp = tempfile.mkstemp(prefix="incomplete-", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def announce(step, path, final=False):
    """Announces a complete checkpoint: writes ``LATEST`` atomically.

    ``final=True`` says the job finished with it: should the agent lose a
    rank's exit code (its supervisor killed with the agent), the rank then
    counts as finished rather than failed."""
    if not isinstance(step, int) or step < 0:
        raise ValueError("step must be a non-negative integer")
    v = {"step": step, "path": str(path)}
    if final:
        v["final"] = True
    body = json.dumps(v)

    def write(tmp):
        with open(tmp, "w") as f:
            f.write(body)

    _atomic_write(os.path.join(checkpoint_dir(), LATEST), write)


def save(step, write, name=None, final=False):
    """Saves a checkpoint and announces it.

    ``write(tmp_path)`` writes the checkpoint to a temporary path (for example
    ``lambda p: torch.save(state, p)``); it is renamed to ``name`` (default
    ``step-<step>``) in the checkpoint directory, then ``LATEST`` points at
    it. A crash midway leaves the previous checkpoint announced. Returns the
    checkpoint's path. ``final=True`` marks the job's last checkpoint (see
    ``announce``).
    """
    path = os.path.join(checkpoint_dir(), name or "step-%d" % step)
    _atomic_write(path, write)
    announce(step, path, final)
    return path


def latest():
    """``{"step": N, "path": "..."}`` from ``LATEST``, or ``None``."""
    d = os.environ.get("GANGWAY_CHECKPOINT_DIR")
    if not d:
        return None
    try:
        with open(os.path.join(d, LATEST)) as f:
            v = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(v, dict) or not isinstance(v.get("step"), int) or not v.get("path"):
        return None
    path = v["path"]
    if not os.path.isabs(path):
        path = os.path.join(d, path)
    return {"step": v["step"], "path": path}


def resume_from():
    """The checkpoint to resume from: ``$GANGWAY_RESUME_FROM`` (the server's
    record of the last reported checkpoint), else what ``LATEST`` says, else
    ``None`` (a fresh start)."""
    p = os.environ.get("GANGWAY_RESUME_FROM")
    if p:
        return p
    l = latest()
    return l["path"] if l else None
