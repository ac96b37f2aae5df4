"""The host tenant store: adapters and optimizer states of the tenants that do not sit in a model slot right now.

More tenants than slots (`model.max_tenants` > `model.max_loras`): the model keeps `max_loras` resident slots and
every other tenant's state waits here, in host memory, spilled to disk past `model.host_budget_gb`. The trainer's
per-tenant operations (`rl_multilora.train_ops.TrainOps`) page a tenant into a slot when something needs it (a GRPO
step that trains it, a client request, a checkpoint) and evict the least recently used resident tenant to make room.

Design choices:
- What is stored is exactly what the slot and the optimizer held, at the adapter's true rank: each slot tensor's
  first `rank` ranks (A `(r, in)`, B `(out, r)`, experts with their expert dim), one after the other in one flat
  tensor (the trainer pages a step's tenants out and in with one gather / scatter per stacked tensor for all of
  them: `MultiLoRAModel.take_adapters` / `place_adapters`), and its AdamW moments, which the optimizer keeps at
  the true rank (its parameters are true-rank views of the slot), handed over as they are, without a copy; the step
  counts, param-group settings and LR schedule never leave the tenant's `TenantOptimizer`. The ranks above `rank`
  hold exact zeros in the slot (`rl_multilora.lora.layer`), and a free slot holds only zeros, so a page-in that
  writes the first `rank` ranks gives back every bit: a run on few slots ends bit-identical to the same step order
  on enough slots (`tests/test_paging.py`). An idle tenant costs its true-rank adapter plus two moments: 3x its
  adapter bytes.
- A tenant's accumulated gradient (a Tinker client between `forward_backward` and `optim_step`) travels with it,
  at its true rank like its parameters: the gradient of the ranks above is a product with exact zeros, non-finite
  only when the rows' activations or upstream gradient are, which makes the ranks below non-finite too.
- The budget counts host bytes of paged tenants; past it the least recently paged-out ones are written to
  `spill_dir` (one `torch.save` file each, read back with `weights_only`) and their host copies dropped. Spill files
  are a cache, not checkpoints: resume reads checkpoints, and the store starts empty. So `close` deletes the spill
  files it wrote (and the folder, when it made it or it is left empty): a finished run on a small budget would
  otherwise leave 3x every idle tenant's adapter bytes in `run_dir/paged` for good. Each store writes into a folder
  of its own inside `spill_dir` (two runs or servers given one scratch folder and a tenant name in common read each
  other's adapters otherwise), and holds an exclusive `flock` on a lock file in it while it lives: a store that may
  spill removes the folders left by stores whose process died without `close` (a SIGKILL, an OOM kill), which nobody
  holds a lock on, so killed and resumed runs do not pile up spill files. A spill that fails (a full disk) keeps the
  tenant in host memory over the budget, with a warning: the budget is a preference, losing a tenant's state is not
  an option.
- Page-in time is measured by the caller that pages (it includes the eviction that made room); the store counts
  its own spills and loads.
- Prefetch (`stage`): a tenant that a coming step will page in can be prepared in one background thread while the
  current step trains: read back from disk if it was spilled, and made into exactly what its slot and optimizer
  take (the caller's `prepare`: tensors on the slots' device, moments zero-padded to the slot's shape). The model's
  slots are not touched (the training step's autograd reads them); the page-in itself (`take`) then only copies
  the prepared weights into a slot. `prepare` must produce the tensors the synchronous page-in would produce, so a
  prefetched run is bit-identical to one that pages on demand (`tests/test_paging_async.py`). One lock guards the
  store's books: the training thread pages out (put, spill) while the prefetch thread takes. A staged tenant is out
  of `host_bytes` and the budget (it is on its way into a slot; at most `max_loras` are staged at once).
- `peek` reads a paged tenant's weights without taking it out (a weight sync pushing a changed adapter that was
  evicted before its sync: the push must not page it back in and evict another).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rl_multilora.errors import bad_value

try:
    import fcntl
except ImportError:  # not on POSIX: folders of killed runs stay (there is no lock to tell the dead from the living)
    fcntl = None

log = logging.getLogger(__name__)

FOLDER_PREFIX = "rl-multilora-paged-"
LOCK_FILE = ".owner.lock"
# A folder without its lock file is one being made right now (the lock follows `mkdtemp` at once) or one of a store
# killed in between: removed only once it is this old.
UNLOCKED_GRACE_S = 600.0


@dataclass
class PagedTenant:
    """One tenant's slot and optimizer state outside the model, at its true rank."""

    rank: int
    alpha: float
    modules: frozenset[str]  # the LoRA modules / expert Parameters its slot covers
    weights: torch.Tensor | None  # flat: each slot tensor's first `rank` ranks (`MultiLoRAModel.take_adapters`)
    moments: list[dict[str, torch.Tensor]] | None  # per slot tensor, its AdamW state (moments at true rank)
    grads: list[torch.Tensor | None] | None = None  # accumulated since its last optim_step, full slot shape
    spilled: Path | None = None  # where its tensors are while they are not in host memory
    peft_config: dict | None = None  # its adapter_config.json content (what a weight sync pushes with it)
    prepared: bool = False  # staged by a prefetch: tensors on the slots' device, moments at the slot's shape

    held: int = 0  # host bytes the store counts for it (its `nbytes` when put; 0 while spilled)

    @property
    def nbytes(self) -> int:
        tensors = [self.weights, *(self.grads or [])]
        tensors += [v for state in self.moments or [] for v in state.values()]
        return sum(t.nbytes for t in tensors if t is not None)


@dataclass
class StoreStats:
    """Counters since the store was made (callers take differences per step)."""

    page_ins: int = 0
    page_outs: int = 0
    page_in_s: float = 0.0
    page_out_s: float = 0.0
    spills: int = 0
    loads: int = 0
    staged: int = 0  # prefetches started
    staged_taken: int = 0  # page-ins that found their tenant prefetched
    by_tenant: dict[str, int] = field(default_factory=dict)  # page-ins per tenant


class TenantStore:
    """Paged-out tenants by name: host memory up to `budget_bytes` (None: no limit), the rest in `spill_dir` (a
    temporary folder when None, made on the first spill)."""

    def __init__(self, budget_bytes: int | None = None, spill_dir: str | Path | None = None):
        if budget_bytes is not None and (isinstance(budget_bytes, bool) or budget_bytes < 0):
            raise ValueError(bad_value("budget_bytes", budget_bytes, "a number of bytes >= 0 or None"))
        self.budget_bytes = budget_bytes
        self._spill_root = Path(spill_dir) if spill_dir is not None else None  # where this store's folder goes
        self._spill_dir: Path | None = None  # this store's own folder, made on the first spill, removed on close
        self._made_root = False  # `spill_dir` did not exist: made on the first spill, removed on close when empty
        self._spill_failed = False  # a spill failed (warned once)
        self._owner_lock: int | None = None  # the fd holding this store's folder's flock while it lives
        self._tenants: OrderedDict[str, PagedTenant] = OrderedDict()  # least recently paged out first
        self._staged: dict[str, concurrent.futures.Future[PagedTenant]] = {}  # prefetched (or being prefetched)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # made on the first prefetch
        self._lock = threading.RLock()
        self.host_bytes = 0  # of the tenants in `_tenants` (staged ones are on their way into a slot)
        self.disk_bytes = 0
        self.stats = StoreStats()
        if budget_bytes is not None:  # a store that may spill: what killed stores left where it would spill
            root = self._spill_root if self._spill_root is not None else Path(tempfile.gettempdir())
            if root.is_dir():
                _remove_dead_folders(root)

    def __contains__(self, name: str) -> bool:
        return name in self._tenants or name in self._staged

    def __len__(self) -> int:
        return len(self._tenants) + len(self._staged)

    @property
    def names(self) -> list[str]:
        with self._lock:
            return [*self._tenants, *self._staged]

    def spilled(self) -> list[str]:
        with self._lock:
            return [n for n, p in self._tenants.items() if p.spilled is not None]

    def staged(self) -> list[str]:
        """Tenants a prefetch has taken out of the store for their next page-in (some may still be in flight)."""
        return list(self._staged)

    def put(self, name: str, paged: PagedTenant) -> None:
        """Hold `name`'s state (its tensors must already be host copies); spill past the budget."""
        with self._lock:
            if name in self:
                raise ValueError(bad_value("name", name, "a tenant that is not paged out already"))
            self._tenants[name] = paged
            paged.held = paged.nbytes
            self.host_bytes += paged.held
            self._spill_over_budget()

    def take(self, name: str) -> PagedTenant:
        """Remove and return `name`'s state: the prefetched one (waiting for it) when it was staged, else read back
        from disk when it was spilled."""
        with self._lock:
            staged = self._staged.pop(name, None)
            if staged is None:
                paged = self._pop(name)
                try:
                    return self._unspill(paged)
                except BaseException:
                    self.put_back(name, paged)  # still spilled: its file was not removed
                    raise
        self.stats.staged_taken += 1
        try:
            return staged.result()
        except BaseException:
            self.put_back(name, staged.original)  # type: ignore[attr-defined]
            raise

    def stage(self, names: Iterable[str], prepare: Callable[[PagedTenant], PagedTenant]) -> list[str]:
        """Prefetch: take each of `names` that waits here out of the store and run `prepare` on it in the background
        thread; its next `take` returns what `prepare` returned. Returns the names staged now."""
        started = []
        with self._lock:
            for name in names:
                if name not in self._tenants:
                    continue
                paged = self._pop(name)
                if self._pool is None:
                    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tenant-prefetch")
                future = self._pool.submit(lambda p=paged: prepare(self._unspill(p)))
                future.original = paged  # type: ignore[attr-defined] - what `take` puts back when the prefetch failed
                self._staged[name] = future
                self.stats.staged += 1
                started.append(name)
        return started

    def peek(self, name: str) -> PagedTenant:
        """`name`'s state without taking it out (read from its spill file when spilled; waits for a prefetch in
        flight). Its tensors are the store's: read them, never write them."""
        with self._lock:
            staged = self._staged.get(name)
            paged = self._tenants.get(name) if staged is None else None
        if staged is not None:
            return staged.result()
        if paged is None:
            raise KeyError(bad_value("name", name, "a tenant in the store"))
        if paged.spilled is None:
            return paged
        saved = torch.load(paged.spilled, weights_only=True)
        return PagedTenant(
            paged.rank, paged.alpha, paged.modules, saved["weights"], saved["moments"], saved["grads"],
            peft_config=paged.peft_config,
        )  # fmt: skip

    def drop(self, name: str) -> None:
        """Forget `name` (a tenant that left) and its spill file."""
        with self._lock:
            staged = self._staged.pop(name, None)
            if staged is None:
                paged = self._pop(name)
                if paged.spilled is not None:
                    self.disk_bytes -= paged.spilled.stat().st_size
                    paged.spilled.unlink()
                return
        # a prefetch in flight finishes before its tensors go; waited for outside the lock, which the prefetch
        # thread takes to read a spilled tenant back (waiting under it deadlocked)
        concurrent.futures.wait([staged])

    def close(self) -> None:
        """Stop the prefetch thread (after what it is doing), then delete the spill files (a cache nothing reads
        after the store: resume starts from checkpoints) and the spill folder when the store made it or it is now
        empty. Tenants in host memory stay readable (`peek`) until the store is dropped."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        with self._lock:
            for name in self.spilled():
                paged = self._pop(name)
                self.disk_bytes -= paged.spilled.stat().st_size
                paged.spilled.unlink()
            if self._owner_lock is not None:
                (self._spill_dir / LOCK_FILE).unlink(missing_ok=True)  # while held: no sweep takes it as dead
                os.close(self._owner_lock)
                self._owner_lock = None
            if self._spill_dir is not None and self._spill_dir.is_dir() and not any(self._spill_dir.iterdir()):
                self._spill_dir.rmdir()
                root = self._spill_dir.parent
                if (self._made_root or self._spill_root is None) and not any(root.iterdir()):
                    root.rmdir()

    def _pop(self, name: str) -> PagedTenant:
        """Out of the books: `name`'s state as held (maybe spilled)."""
        paged = self._tenants.pop(name)
        self.host_bytes -= paged.held
        paged.held = 0
        return paged

    def put_back(self, name: str, paged: PagedTenant) -> None:
        """A tenant whose page-in failed goes back into the books as it was (never lost between store and slot)."""
        with self._lock:
            if name not in self._tenants:
                self._tenants[name] = paged
                self._tenants.move_to_end(name, last=False)  # the first to spill again, as it was
                paged.held = 0 if paged.spilled is not None else paged.nbytes
                self.host_bytes += paged.held

    def _unspill(self, paged: PagedTenant) -> PagedTenant:
        """Read a popped tenant's tensors back from its spill file (a no-op when it was in host memory). The tenant
        stays spilled until its tensors are read (a failed read leaves it as it was)."""
        if paged.spilled is None:
            return paged
        path = paged.spilled
        saved = torch.load(path, weights_only=True)
        paged.weights, paged.moments, paged.grads = saved["weights"], saved["moments"], saved["grads"]
        paged.spilled = None
        with self._lock:
            self.disk_bytes -= path.stat().st_size
            self.stats.loads += 1
        path.unlink()
        return paged

    def _spill_over_budget(self) -> None:
        if self.budget_bytes is None:
            return
        for name, paged in self._tenants.items():
            if self.host_bytes <= self.budget_bytes:
                return
            if paged.spilled is None and not self._spill(name, paged):
                return  # the disk refused one: not every tenant in turn

    def _spill(self, name: str, paged: PagedTenant) -> bool:
        """Write `paged` to its file and drop its host tensors; False (and a warning, once) when the write failed."""
        if self._spill_dir is None:
            if self._spill_root is not None and not self._spill_root.exists():
                self._spill_root.mkdir(parents=True)
                self._made_root = True
            self._spill_dir = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=self._spill_root))
            self._owner_lock = _hold_lock(self._spill_dir)
        path = self._spill_dir / f"{name}.pt"
        try:
            torch.save({"weights": paged.weights, "moments": paged.moments, "grads": paged.grads}, path)
        except Exception as e:  # noqa: BLE001 - a full disk: the tenant stays in host memory, over the budget
            path.unlink(missing_ok=True)
            if not self._spill_failed:
                log.warning("could not spill tenant %s to %s (%s: %s): paged-out tenants stay in host memory past "
                            "model.host_budget_gb until a spill succeeds", name, path, type(e).__name__, e)  # fmt: skip
            self._spill_failed = True
            return False
        paged.weights = paged.moments = paged.grads = None
        paged.spilled = path
        self.host_bytes -= paged.held
        paged.held = 0
        self.disk_bytes += path.stat().st_size
        self.stats.spills += 1
        return True


def _hold_lock(folder: Path) -> int | None:
    """Take an exclusive `flock` on `folder`'s lock file and keep it (the fd) while the store lives; the kernel drops
    it when the process dies, however it dies. None where there is no `flock`."""
    if fcntl is None:
        return None
    fd = os.open(folder / (LOCK_FILE + ".new"), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh file in a fresh folder of our own: nobody holds it
    os.replace(folder / (LOCK_FILE + ".new"), folder / LOCK_FILE)  # a sweep sees the lock file only once it is held
    return fd


def _remove_dead_folders(root: Path) -> None:
    """Remove the spill folders in `root` whose store died without `close`: their lock file is not held (taking the
    lock succeeds), or they have none and are older than `UNLOCKED_GRACE_S`. A living store's folder is never
    touched; failures are logged, never raised (a cache's leftovers must not stop a run)."""
    if fcntl is None:
        return
    for folder in root.glob(FOLDER_PREFIX + "*"):
        if not folder.is_dir():
            continue
        try:
            lock = folder / LOCK_FILE
            if lock.exists():
                fd = os.open(lock, os.O_RDWR)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a living store holds it
                finally:
                    os.close(fd)
            elif time.time() - folder.stat().st_mtime < UNLOCKED_GRACE_S:
                continue
            size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
            shutil.rmtree(folder)
            log.info("removed %s, the spill folder of a run that did not close it (%.1f MB)", folder, size / 1e6)
        except OSError as e:  # noqa: PERF203 - another store removing it too, a permission: leave it
            log.warning("could not remove the stale spill folder %s: %s", folder, e)
