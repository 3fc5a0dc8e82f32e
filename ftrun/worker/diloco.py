"""DiLoCo's outer loop on one DDP model (`--hook diloco --period H`): semi-synchronous training.

Between two syncs every replica trains alone: the DDP comm hook sends nothing (each replica steps
its own optimizer, the inner one, on its own gradients). Every H steps of that optimizer, the
replicas average their pseudo-gradients (the global model as of the last sync less their own
parameters now), an outer optimizer (SGD with Nesterov momentum, `--outer-lr`, `--outer-momentum`)
steps the global model on that average, and every replica takes the new global model as its
parameters. With --outer-lr 1 and --outer-momentum 0 that is periodic parameter averaging
(--hook localsgd with --start-iter 0).

Streaming (`--fragments F`): the model's trained tensors are cut into F fragments of about equal
size, in parameter order; fragment f syncs at the inner steps where `steps % H == f*H//F`, so
each fragment still syncs every H steps but the link carries about 1/F of the model at a time.
With `--sync-delay D` a fragment's average is started at its sync and applied D inner steps
later: the exchange runs while the replicas compute those steps, and the fragment's parameters
then take the new global fragment (what the replica's own steps did to that fragment meanwhile
is dropped, as torchft's streaming DiLoCo does with its default fragment_update_alpha of 0).

What a sync sends: with no --wrap, the flattened pseudo-gradients in their own precision, one
all-reduce per dtype; with --wrap fp16|bf16 in half precision (summed and divided in full
precision); with --wrap int8 as int8 with one fp32 scale per chunk, in two exchanges (each
replica sends chunk j of its pseudo-gradient to replica j, which dequantizes, averages in full
precision in replica order and quantizes the average; then every replica gathers the averaged
chunks): a quarter of the fp32 bytes. Each replica keeps the rounding error of what it sent and
adds it to its next pseudo-gradient of that fragment (error feedback); the second rounding (of
the average) is the same on every replica and is not fed back. Every replica gets the same bits,
so every replica's global model, outer momentum and synced parameters are bitwise the same.
The inner optimizers' state stays each replica's own, as DiLoCo has it, and so does int8's error.

Must never send anything between syncs, never issue a collective from state_dict() (a script may
save on one rank only), never touch the user's optimizer but through the parameters it steps,
and never import the supervisor.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
_INT8_MAX = 127.0


def split_fragments(sizes: List[int], fragments: int) -> List[List[int]]:
    """Tensor indices cut into `fragments` runs in order, each near the same number of elements
    (a run holds one tensor at least)."""
    total, runs, at = sum(sizes), [], 0
    for f in range(fragments):
        left = fragments - f  # runs still to make, this one included
        end = at + 1
        goal = total * (f + 1) / fragments
        while end < len(sizes) - (left - 1) and sum(sizes[:end]) + sizes[end] / 2 <= goal:
            end += 1
        if f == fragments - 1:
            end = len(sizes)
        runs.append(list(range(at, end)))
        at = end
    return runs


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: Optional[dist.ProcessGroup],
                       async_op: bool) -> Any:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in newer torch
    return gather(out, inp, group=group, async_op=async_op)


def _quantize(x: torch.Tensor, chunks: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """`x` (1-D, a multiple of `chunks` long) as int8 with one fp32 scale per chunk."""
    rows = x.float().view(chunks, -1)
    scale = rows.abs().amax(dim=1) / _INT8_MAX
    q = torch.where(scale[:, None] > 0, rows / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None],
                    torch.zeros_like(rows)).round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q.view(-1), scale


def _dequantize(q: torch.Tensor, scale: torch.Tensor, chunks: int) -> torch.Tensor:
    return (q.view(chunks, -1).float() * scale[:, None]).view(-1)


class _Exchange:
    """One sync of one fragment's tensors of one dtype and device: the pseudo-gradient sent, and
    the average it comes back as (`mean`, in the tensors' dtype). Stages: "reduce" (one
    all-reduce in flight), "spread" (int8: the chunks exchanged, in flight), "gather" (int8: the
    averaged chunks, to be gathered), "gathering" (in flight), "done"."""

    def __init__(self, idx: List[int], flat: torch.Tensor, world: int, wrap: Optional[str],
                 group: Optional[dist.ProcessGroup], async_op: bool) -> None:
        self.idx, self.world, self.group, self.dtype = idx, world, group, flat.dtype
        self.numel = flat.numel()
        self.work: List[Any] = []
        self.mean: Optional[torch.Tensor] = None
        self.sent_error: Optional[torch.Tensor] = None  # int8: what rounding took from what was sent
        self.bytes = 0
        if world == 1:  # nothing to send: the average is its own
            self.mean, self.stage = flat, "done"
            return
        if wrap == "int8":
            padded = torch.nn.functional.pad(flat.float(), (0, -self.numel % world))
            q, scale = _quantize(padded, world)
            self.sent_error = flat - _dequantize(q, scale, world)[:self.numel].to(flat.dtype)
            self.chunk = padded.numel() // world
            self.recv, self.recv_scale = torch.empty_like(q), torch.empty_like(scale)
            self.work = [dist.all_to_all_single(self.recv_scale, scale, group=group, async_op=async_op),
                         dist.all_to_all_single(self.recv, q, group=group, async_op=async_op)]
            self.stage, self.bytes = "spread", q.numel() + 4 * scale.numel()
        else:
            self.sent = flat.to(_HALF[wrap]) if wrap in _HALF else flat
            self.work = [dist.all_reduce(self.sent, group=group, async_op=async_op)]
            self.stage, self.bytes = "reduce", self.sent.numel() * self.sent.element_size()

    def settle(self) -> None:
        """Wait for the exchange in flight and take in what it brought: never a new collective."""
        for w in self.work:
            if w is not None:
                w.wait()
        self.work = []
        if self.stage == "reduce":
            self.mean = self.sent.to(self.dtype).div_(self.world)
            self.sent, self.stage = None, "done"
        elif self.stage == "spread":
            # This replica's chunk of every replica's pseudo-gradient, averaged in replica order.
            parts = _dequantize(self.recv, self.recv_scale, self.world).view(self.world, -1)
            mine = parts[0].clone()
            for part in parts[1:]:
                mine += part
            self.mine_q, self.mine_scale = _quantize(mine.div_(self.world), 1)
            self.recv = self.recv_scale = None
            self.stage = "gather"
        elif self.stage == "gathering":
            self.mean = _dequantize(self.all_q, self.all_scale, self.world)[:self.numel].to(self.dtype)
            self.all_q = self.all_scale = None
            self.stage = "done"

    def _gather(self, async_op: bool) -> None:
        self.all_q = torch.empty(self.world * self.chunk, dtype=torch.int8, device=self.mine_q.device)
        self.all_scale = torch.empty(self.world, dtype=torch.float32, device=self.mine_q.device)
        self.work = [_all_gather_single(self.all_scale, self.mine_scale, self.group, async_op),
                     _all_gather_single(self.all_q, self.mine_q, self.group, async_op)]
        self.stage = "gathering"  # counted with the exchange: the bytes of one all-reduce of the int8 payload

    def advance(self) -> None:
        """int8: once the chunks were exchanged, start the gather of the averaged ones (in flight);
        an all-reduce in flight is left to run."""
        if self.stage == "spread":
            self.settle()
        if self.stage == "gather":
            self._gather(async_op=True)

    def finish(self) -> torch.Tensor:
        """The average, waiting for what is in flight (and gathering it first where that is due)."""
        self.settle()
        if self.stage == "gather":
            self._gather(async_op=False)
            self.settle()
        assert self.mean is not None
        return self.mean

    def state(self) -> Dict[str, Any]:
        """Plain tensors: where it stands once settled (the caller settled it)."""
        base = {"idx": list(self.idx), "world": self.world, "numel": self.numel, "dtype": str(self.dtype)}
        if self.stage == "gather":
            return {**base, "stage": "gather", "chunk": self.chunk, "q": self.mine_q.clone(),
                    "scale": self.mine_scale.clone()}
        assert self.stage == "done" and self.mean is not None
        return {**base, "stage": "done", "mean": self.mean.clone()}

    @classmethod
    def restore(cls, s: Dict[str, Any], group: Optional[dist.ProcessGroup], device: torch.device) -> "_Exchange":
        x = cls.__new__(cls)
        x.idx, x.world, x.group, x.numel = [int(i) for i in s["idx"]], int(s["world"]), group, int(s["numel"])
        x.dtype = getattr(torch, str(s["dtype"]).replace("torch.", ""))
        x.work, x.sent_error, x.bytes, x.mean = [], None, 0, None
        if s["stage"] == "gather":
            x.stage, x.chunk = "gather", int(s["chunk"])
            x.mine_q, x.mine_scale = s["q"].to(device).clone(), s["scale"].to(device).clone()
        else:
            x.stage, x.mean = "done", s["mean"].to(device).clone()
        return x


class _Sync:
    """A fragment's sync in flight: started at inner step `at`, applied at step `due`."""

    def __init__(self, fragment: int, due: int, exchanges: List[_Exchange]) -> None:
        self.fragment, self.due, self.exchanges = fragment, due, exchanges


class Outer:
    """The global model (`anchor`: one tensor per trained parameter), its outer optimizer, the
    fragments and the syncs in flight, and the inner steps counted since the run began, for the
    parameters of one model."""

    def __init__(self, params: List[torch.Tensor], period: int, outer_lr: float, outer_momentum: float,
                 group: Optional[dist.ProcessGroup], wrap: Optional[str] = None, fragments: int = 1,
                 sync_delay: int = 0) -> None:
        self.params = params
        self.period = period
        self.group = group
        self.wrap = wrap
        self.sync_delay = sync_delay
        if fragments > len(params):
            raise SystemExit(f"ftrun: error: --fragments {fragments}: this model has {len(params)} trained "
                             f"tensor{'s' if len(params) != 1 else ''} (a fragment holds whole tensors); use "
                             f"--fragments {max(1, len(params))} or fewer")
        self.fragments = split_fragments([p.numel() for p in params], fragments)
        self.offsets = [f * period // fragments for f in range(fragments)]
        # Taken when the hook is registered, after DDP's constructor broadcast rank 0's parameters:
        # the same global model on every replica.
        self.anchor = [p.detach().clone() for p in params]
        self.outer = torch.optim.SGD(self.anchor, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=outer_momentum > 0)
        self.error: Dict[Tuple[int, int], torch.Tensor] = {}  # int8: (fragment, exchange) -> rounding error fed back
        self.pending: List[_Sync] = []
        self.steps = 0          # inner steps of the counted optimizer
        self.syncs = 0          # fragment syncs applied (with one fragment: whole-model syncs)
        # The syncs' payload, as the hooks count bytes: an all-reduce's buffer (int8: the quantized
        # pseudo-gradient and its scales, which its two exchanges carry as one all-reduce would).
        self.sync_bytes = 0
        self._counted: Optional[int] = None  # id() of the optimizer whose steps are counted

    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer stepped: count it if it is the one counted (the first that stepped any of
        this model's parameters: a loop with two optimizers on one model syncs once per iteration),
        apply the syncs due, move the ones in flight on, and start the fragments' syncs due now."""
        mine = {id(p) for p in self.params}
        if not any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
            return
        if self._counted is None:
            self._counted = id(optimizer)
        if id(optimizer) != self._counted:
            return
        self.steps += 1
        for sync in [s for s in self.pending if s.due <= self.steps]:
            self._apply(sync)
        for sync in self.pending:
            for x in sync.exchanges:
                x.advance()
        for f, off in enumerate(self.offsets):
            if self.steps % self.period == off:
                self._start(f)

    def next_sync(self) -> int:
        """The inner step at which the next fragment's sync starts (with one fragment: the next sync)."""
        return min((self.steps - off) // self.period * self.period + self.period + off for off in self.offsets)

    @torch.no_grad()
    def _start(self, f: int) -> None:
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        by_kind: Dict[Any, List[int]] = {}
        for i in self.fragments[f]:
            by_kind.setdefault((self.params[i].dtype, self.params[i].device), []).append(i)
        exchanges = []
        for n, idx in enumerate(by_kind.values()):
            flat = torch.cat([(self.anchor[i] - self.params[i].detach()).reshape(-1) for i in idx])
            fed = self.error.get((f, n))
            if fed is not None:
                flat += fed
            x = _Exchange(idx, flat, world, self.wrap, self.group, async_op=self.sync_delay > 0)
            if x.sent_error is not None:
                self.error[(f, n)] = x.sent_error
                x.sent_error = None
            exchanges.append(x)
        sync = _Sync(f, self.steps + self.sync_delay, exchanges)
        if self.sync_delay == 0:
            self._apply(sync, started=False)
        else:
            self.pending.append(sync)

    @torch.no_grad()
    def _apply(self, sync: _Sync, started: bool = True) -> None:
        """The outer step on the fragment's global tensors, and the fragment's parameters set to them."""
        if started:
            self.pending.remove(sync)
        for x in sync.exchanges:
            mean = x.finish()
            self.sync_bytes += x.bytes
            at = 0
            for i in x.idx:
                n = self.anchor[i].numel()
                self.anchor[i].grad = mean[at:at + n].view_as(self.anchor[i]).clone()
                at += n
        self.outer.step()  # only the fragment's tensors have a gradient: the others are left as they are
        for x in sync.exchanges:
            for i in x.idx:
                self.anchor[i].grad = None
                self.params[i].copy_(self.anchor[i])
        self.syncs += 1

    def figures(self) -> Dict[str, Any]:
        out = {"steps": self.steps, "syncs": self.syncs, "period": self.period, "next_sync": self.next_sync(),
               "sync_bytes": self.sync_bytes}
        if len(self.fragments) > 1 or self.sync_delay:
            out.update(fragments=len(self.fragments), sync_delay=self.sync_delay, in_flight=len(self.pending))
        return out

    def state_dict(self) -> Dict[str, Any]:
        """Plain tensors and numbers (torch.load(weights_only=True) takes them): the global model,
        the outer momentum, the step count, int8's fed-back errors and the syncs in flight (their
        exchanges waited for, never one started: a script may save on one rank only)."""
        moms = [self.outer.state.get(a, {}).get("momentum_buffer") for a in self.anchor]
        pending = []
        for sync in self.pending:
            for x in sync.exchanges:
                x.settle()
            pending.append({"fragment": sync.fragment, "due": sync.due, "exchanges": [x.state() for x in sync.exchanges]})
        out: Dict[str, Any] = {"kind": "diloco", "steps": self.steps, "syncs": self.syncs,
                               "fragments": [list(f) for f in self.fragments], "wrap": self.wrap or "",
                               "anchor": [a.detach().clone() for a in self.anchor],
                               "momentum": [m.detach().clone() if m is not None else torch.empty(0) for m in moms]}
        if self.error:
            out["error"] = {f"{f}.{n}": e.clone() for (f, n), e in self.error.items()}
        if pending:
            out["pending"] = pending
        return out

    @torch.no_grad()
    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Refused in one line (ValueError) when it was saved with other fragments or another
        --wrap: its fed-back errors and syncs in flight are of tensors this run cuts otherwise."""
        saved = [[int(i) for i in f] for f in state.get("fragments") or [list(range(len(self.anchor)))]]
        if saved != self.fragments or str(state.get("wrap") or "") != (self.wrap or ""):
            raise ValueError(f"ftrun: this DiLoCo state was saved with --fragments {len(saved)}"
                             f"{' --wrap ' + state['wrap'] if state.get('wrap') else ''} (or another model); this "
                             f"run has --fragments {len(self.fragments)}{' --wrap ' + self.wrap if self.wrap else ''}: "
                             f"resume with the options it was saved with")
        self.steps, self.syncs = int(state["steps"]), int(state["syncs"])
        for a, saved in zip(self.anchor, state["anchor"]):
            a.copy_(saved)
        for a, m in zip(self.anchor, state["momentum"]):
            if m.numel():
                self.outer.state[a]["momentum_buffer"] = m.to(a.device).clone()
            else:
                self.outer.state.pop(a, None)
        device = self.anchor[0].device if self.anchor else torch.device("cpu")
        self.error = {}
        for key, e in (state.get("error") or {}).items():
            f, n = key.split(".")
            self.error[(int(f), int(n))] = e.to(device).clone()
        self.pending = [_Sync(int(p["fragment"]), int(p["due"]),
                              [_Exchange.restore(x, self.group, self.anchor[int(x["idx"][0])].device)
                               for x in p["exchanges"]])
                        for p in state.get("pending") or []]
