"""`RolloutEngine`: continuous-batching generation on the trainer's own model (same modules, kernels, packed base).

Synchronous use (the RL loop): `engine.generate(prompts, SamplingParams(...))`. Driven use (a dedicated-GPU
loop, streaming): `add_request(...)`, then `step()` until `has_unfinished()` is False; each step returns the
`RequestOutput`s that changed. `stage_adapter` / `activate_adapter` are applied between steps, so every forward
sees one consistent adapter version (see `adapter_slots.py` for the in-flight policy).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import threading
from collections import defaultdict

import torch
from torch import Tensor, nn

from ..models.invariant import invariant_mode
from ..quant.fusion import fuse_projections
from ..triton_kernels import kernels_module, kernels_run_on
from .adapter_slots import AdapterSlots
from .blocks import BlockAllocator, blocks_for
from .cuda_graphs import DecodeGraphs, capture_blocker
from .kv_cache import KVLayout, PagedKVCache, free_memory_bytes
from .outputs import RequestOutput
from .params import SamplingParams
from .runner import DecodeInputs, ModelRunner
from .sampling import RowSampling, make_generator, sample_seed, sampled_logprobs
from .scheduler import Scheduler
from .sequence import Request, Sequence, append_tokens

log = logging.getLogger(__name__)


class RolloutEngine:
    """Generates with `model` (a `CausalLM`, optionally on a packed base and with an adapter), in place: the
    engine adds two adapter slots to the model and a KV cache beside it, and copies no base weight. Packed
    projections that read one input (q/k/v, gate/up) are re-seated as slices of one buffer each, so decode
    runs each group as one matmul (`quant.fusion`); every other path reads the same values through the views.

    - KV memory: `kv_budget_bytes`, or `kv_fraction` of the device's free memory, or by default what
      `max_batch_size` sequences of `max_model_len` tokens need, capped at half the free memory.
      `block_size` tokens per block; `max_model_len` (default: the model's) bounds prompt + completion.
    - `max_batch_size` sequences decode at once; `max_prefill_tokens` bounds the padded tokens of one prefill
      forward (activation memory). `cuda_graphs` captures decode on CUDA for models that allow it
      (`cuda_graphs.capture_blocker` names what stops one, e.g. experts in a format the kernels do not read).
    - `decode_steps` (default 8 on CUDA, 1 elsewhere): tokens each running sequence decodes per engine step,
      fed back on the device, with one host read at the end (multi-step decode: Python's per-token work no
      longer idles the GPU; with CUDA graphs the whole engine step is one graph launch). A sequence that stops
      inside a step keeps only its tokens up to the stop; the rest was wasted work. New requests join, and
      adapter versions switch, between engine steps.
    - `adapter_policy`: "finish" (in-flight sequences finish on their version) or "switch"; see adapter_slots.
    - `deterministic=True` runs every forward and the recorded log-probs in batch-invariant mode
      (`orbit_lightning.models.invariant.invariant_mode`), so a row's numbers do not depend on its batch: on
      the GPU, the trainer scoring the same tokens in that mode gets bit-identical log-probs.
    """

    def __init__(self, model: nn.Module, tokenizer=None, *, kv_budget_bytes: int | None = None,
                 kv_fraction: float | None = None, block_size: int = 16, max_batch_size: int = 256,
                 max_model_len: int | None = None, max_prefill_tokens: int = 8192, cuda_graphs: bool = True,
                 deterministic: bool = False, adapter_policy: str = "finish", decode_steps: int | None = None):
        cfg = model.config
        embed = model.model.embed_tokens.weight
        decode_steps = decode_steps if decode_steps is not None else (8 if embed.device.type == "cuda" else 1)
        for name, val in (("block_size", block_size), ("max_batch_size", max_batch_size),
                          ("max_prefill_tokens", max_prefill_tokens), ("decode_steps", decode_steps)):
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        if not 1 < self.max_model_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} must be in [2, max_position_embeddings="
                             f"{cfg.max_position_embeddings}]")
        self.model, self.tokenizer, self.block_size = model, tokenizer, block_size
        self.decode_steps = decode_steps
        self.device, self.vocab_size = embed.device, cfg.vocab_size
        self.eos_ids = set(cfg.eos_token_ids)
        layout = KVLayout.from_config(cfg, embed.dtype)
        num_blocks = self._num_blocks(layout, kv_budget_bytes, kv_fraction, max_batch_size)
        self.cache = PagedKVCache(layout, num_blocks, block_size, self.device)
        self.allocator = BlockAllocator(num_blocks)
        self.scheduler = Scheduler(self.allocator, block_size, max_batch_size, max_prefill_tokens)
        self.slots = AdapterSlots(model, adapter_policy)
        # q/k/v and gate/up of a packed base become row slices of one buffer each, so a decode step reads each
        # group in one GEMV (quant.fusion); the trainer sees the same values through the views.
        self.fused_projections = fuse_projections(model)
        max_blocks = blocks_for(self.max_model_len, block_size)
        self.runner = ModelRunner(model, self.cache, max_blocks, None, graph_steps=decode_steps)
        self.graphs_disabled_reason = ("cuda_graphs=False" if not cuda_graphs
                                       else capture_blocker(model, self.device, deterministic))
        if self.graphs_disabled_reason is None:
            forwards = {"hidden": self.runner.decode_hidden, "sampled": self.runner.decode_sampled,
                        "steps": self.runner.decode_sampled_steps}
            self.runner.graphs = DecodeGraphs(forwards, DecodeInputs.PADDING, max_batch_size, max_blocks, self.device)
        self._mode = _batch_invariant_mode(self.device) if deterministic else contextlib.nullcontext
        self.deterministic = deterministic
        self._requests: dict[str, Request] = {}
        self._to_report: list[Request] = []  # rejected, empty or aborted: answered at the next step
        self._arrivals = itertools.count()
        self._lock = threading.RLock()
        # Triton launches on the *current* CUDA device, not the tensors' one: an engine on another GPU than the
        # trainer's (the dedicated strategy) must make its device current while it steps.
        cuda = self.device.type == "cuda"
        self._on_device = (lambda: torch.cuda.device(self.device)) if cuda else contextlib.nullcontext
        self.peak_used_blocks = 0
        self.num_steps = 0  # engine steps (schedule + forwards + one host read each)
        self.decode_forwards = 0  # decode forwards run (a multi-step engine step runs several)

    def _num_blocks(self, layout: KVLayout, budget: int | None, fraction: float | None, max_batch: int) -> int:
        per_block = layout.bytes_per_token() * self.block_size
        if budget is not None and fraction is not None:
            raise ValueError("give kv_budget_bytes or kv_fraction, not both")
        if fraction is not None:
            if not 0 < fraction <= 1:
                raise ValueError(f"kv_fraction must be in (0, 1], got {fraction}")
            budget = int(fraction * free_memory_bytes(self.device))
        elif budget is None:
            need = (max_batch * blocks_for(self.max_model_len, self.block_size) + 1) * per_block
            budget = min(need, free_memory_bytes(self.device) // 2)
        n = budget // per_block
        if n < 2:
            raise ValueError(f"KV budget of {budget} bytes holds {n} blocks of {per_block} bytes; at least 2 are "
                             "needed (one is reserved): raise kv_budget_bytes / kv_fraction or lower block_size")
        return n

    # ---- requests ----------------------------------------------------------------------------------

    def add_request(self, prompt: list[int] | str, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue one prompt -> its request id. A bad request is not raised: it is answered with `.error`."""
        with self._lock:
            arrival = next(self._arrivals)
            rid = str(arrival) if request_id is None else str(request_id)
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already in use; give each request a unique id")
            params = SamplingParams() if params is None else params
            req = Request(rid, [], params, arrival)
            self._requests[rid] = req
            req.error = self._admit_prompt(req, prompt)
            if req.error or params.max_new_tokens == 0:
                if not req.error:
                    req.samples = [Sequence(req, j, None, list(req.prompt_token_ids), finish_reason="length")
                                   for j in range(params.n)]
                self._to_report.append(req)
                return rid
            req.samples = [Sequence(req, j, self._generator(params, j), list(req.prompt_token_ids))
                           for j in range(params.n)]
            self.scheduler.add(req.samples)
            return rid

    def _admit_prompt(self, req: Request, prompt) -> str | None:
        """Fill `req.prompt_token_ids` -> the reason the request cannot run, or None."""
        if not isinstance(req.params, SamplingParams):
            return f"params must be a SamplingParams, got {type(req.params).__name__}"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return "text prompts need a tokenizer: pass RolloutEngine(model, tokenizer=...) or token ids"
            req.prompt = prompt
            try:
                prompt = self.tokenizer.encode(prompt)
            except (ValueError, KeyError, TypeError) as e:
                return f"the tokenizer cannot encode this prompt: {e}"
        try:
            req.prompt_token_ids = [operator.index(t) for t in prompt]
        except TypeError:
            return f"a prompt must be a list of token ids or a string, got {type(prompt).__name__}"
        ids, p = req.prompt_token_ids, req.params
        if not ids:
            return "empty prompt: give at least one token"
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
        problem = p.problem(self.tokenizer is not None)
        if problem:
            return problem
        if len(ids) >= self.max_model_len:
            return (f"prompt of {len(ids)} tokens leaves no room to generate within max_model_len="
                    f"{self.max_model_len}; shorten it or raise max_model_len")
        longest = min(len(ids) + (p.max_new_tokens if p.max_new_tokens is not None else self.max_model_len),
                      self.max_model_len)
        need = blocks_for(longest, self.block_size)
        if need > self.allocator.num_usable:
            return (f"a sample of up to {longest} tokens needs {need} KV blocks but the whole cache has "
                    f"{self.allocator.num_usable}; raise kv_budget_bytes or lower max_new_tokens")
        return None

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.greedy:
            return None
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        return make_generator(sample_seed(seed, index), self.device)

    def abort(self, request_id: str) -> None:
        """Stop a request now; its samples finish with reason "abort" and their blocks are freed."""
        with self._lock:
            req = self._requests.get(str(request_id))
            if req is None:
                raise KeyError(f"no unfinished request with id {request_id!r}")
            for s in req.samples:
                if s.finish_reason is None:
                    self._finish(s, "abort")
            self._to_report.append(req)

    def has_unfinished(self) -> bool:
        return bool(self._to_report) or self.scheduler.has_work()

    # ---- adapter versions --------------------------------------------------------------------------

    def stage_adapter(self, version: int, state: dict[str, Tensor]) -> None:
        """Copy adapter `state` (keys as `adapters.adapter_state_dict` gives) into the inactive slot."""
        with self._lock:
            self.slots.stage(version, state)

    def activate_adapter(self, version: int) -> None:
        """New sequences start on `version` from the next step on; in-flight ones follow the policy."""
        with self._lock:
            if self.slots.activate(version) and self.slots.policy == "switch":
                for s in self.scheduler.running + self.scheduler.waiting:
                    if s.slot is not None:
                        self.slots.unbind(s.slot)
                        s.slot = self.slots.bind()

    def can_stage(self) -> bool:
        return self.slots.can_stage()

    @property
    def adapter_version(self) -> int | None:
        """The version new sequences start on."""
        return self.slots.active_version

    # ---- stepping ----------------------------------------------------------------------------------

    def step(self, stream: bool = True) -> list[RequestOutput]:
        """Run one scheduling step -> outputs of the requests that changed (finished ones for the last time).
        `stream=False` returns only the requests that finished, skipping the per-step snapshots of the others."""
        with self._lock, self._on_device():
            outs = []
            for req in self._step():
                if req.finished:
                    del self._requests[req.request_id]
                if stream or req.finished:
                    outs.append(req.output(self.tokenizer))
            return outs

    def generate(self, prompts: list[list[int]] | list[str],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt -> one RequestOutput each, in order (errors in `.error`)."""
        with self._lock, self._on_device():
            if self.has_unfinished():
                raise RuntimeError(f"generate() needs an idle engine but {len(self._requests)} request(s) added "
                                   "with add_request are unfinished; drive them with step() first")
            if isinstance(params, list) and len(params) != len(prompts):
                raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts; give one, or one each")
            per = params if isinstance(params, list) else [params] * len(prompts)
            ids = [self.add_request(p, sp) for p, sp in zip(prompts, per)]
            while self.has_unfinished():
                self._step()
            return [self._requests.pop(rid).output(self.tokenizer) for rid in ids]

    def _step(self) -> list[Request]:
        touched: dict[str, Request] = {r.request_id: r for r in self._to_report}
        self._to_report = []
        self.num_steps += 1
        plan = self.scheduler.schedule(self._lookahead())
        self.peak_used_blocks = max(self.peak_used_blocks, self.allocator.num_used)
        if plan.copies:
            self.cache.copy_blocks(*map(list, zip(*plan.copies)))
        for job in plan.prefill:
            for s in job.samples:
                if s.slot is None and not s.started:
                    s.slot = self.slots.bind()
        for slot, jobs in _by_slot(plan.prefill, lambda j: j.leader.slot).items():
            with self.slots.use(slot), self._mode():
                logits = self.runner.prefill([j.leader.tokens for j in jobs], [j.leader.block_table for j in jobs])
            rows = [i for i, j in enumerate(jobs) for _ in j.samples]
            seqs = [s for j in jobs for s in j.samples]
            for s in seqs:
                s.num_cached = len(s.tokens)
            with self._mode():  # the recorded log-probs' logsumexp is part of the invariant path
                logits = logits[torch.tensor(rows, device=logits.device)]
                tokens = _row_sampling(seqs).sample(logits)
                self._record(seqs, tokens[:, None].tolist(), sampled_logprobs(logits, tokens)[:, None].tolist())
        for slot, seqs in _by_slot(plan.decode, lambda s: s.slot).items():
            with self.slots.use(slot), self._mode():
                steps = self.runner.decode([s.tokens[-1] for s in seqs], [s.num_cached for s in seqs],
                                           [s.block_table for s in seqs], slot, _row_sampling(seqs), plan.lookahead)
            self.decode_forwards += plan.lookahead
            for s in seqs:
                s.num_cached += plan.lookahead
            tokens, logprobs = steps[:, 0].T.long().tolist(), steps[:, 1].T.tolist()  # [B][steps]
            self._record(seqs, tokens, logprobs)
        for s in [s for j in plan.prefill for s in j.samples] + plan.decode:
            touched[s.request.request_id] = s.request
        return list(touched.values())

    def _lookahead(self) -> int:
        """Decode tokens per sequence this step: `decode_steps`, but not past the point where every running
        sequence has reached its max_new_tokens, nor past any one's max_model_len (its slots must exist)."""
        running = self.scheduler.running
        if self.decode_steps == 1 or not running:
            return 1
        room = min(self.max_model_len - len(s.tokens) for s in running)
        budgets = [s.request.params.max_new_tokens for s in running]
        if None not in budgets:
            room = min(room, max(b - (len(s.tokens) - s.prompt_len) for s, b in zip(running, budgets)))
        return max(1, min(self.decode_steps, room))

    def _record(self, seqs: list[Sequence], tokens: list[list[int]], logprobs: list[list[float]]) -> None:
        """Append each sequence's sampled tokens (one per decode step) up to its stop; sequences already stopped
        drop theirs."""
        for s, toks, lps in zip(seqs, tokens, logprobs):
            if s.finish_reason is not None:
                continue
            version = self.slots.version[s.slot] if s.slot is not None else None
            append_tokens(s, toks, lps, version, self.eos_ids, self.max_model_len, self.tokenizer)
            if s.finish_reason is not None:
                self._finish(s, s.finish_reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.finish(seq)
        self.slots.unbind(seq.slot)
        seq.slot = None

    def stats(self) -> dict[str, int | str | None]:
        return dict(num_blocks=self.allocator.num_usable, free_blocks=self.allocator.num_free,
                    used_blocks=self.allocator.num_used, peak_used_blocks=self.peak_used_blocks,
                    preemptions=self.scheduler.num_preemptions, running=len(self.scheduler.running),
                    waiting=len(self.scheduler.waiting), cuda_graphs=self.graphs_disabled_reason or "on",
                    graphs_captured=self.runner.graphs.num_captured if self.runner.graphs is not None else 0,
                    steps=self.num_steps, decode_forwards=self.decode_forwards)


def _row_sampling(seqs: list[Sequence]) -> RowSampling:
    ps = [s.request.params for s in seqs]
    return RowSampling(torch.tensor([p.temperature for p in ps], dtype=torch.float32),
                       torch.tensor([p.top_k_or_off for p in ps], dtype=torch.long),
                       torch.tensor([p.top_p for p in ps], dtype=torch.float32),
                       [s.generator for s in seqs], [len(s.tokens) - s.prompt_len for s in seqs])


def _by_slot(items: list, slot_of) -> dict[str | None, list]:
    groups: dict[str | None, list] = defaultdict(list)
    for it in items:
        groups[slot_of(it)].append(it)
    return groups


def _batch_invariant_mode(device: torch.device):
    if kernels_module() is None:
        raise ValueError("deterministic=True needs orbit_lightning.kernels, which needs Triton: install triton, or "
                         "pass deterministic=False")
    if not kernels_run_on(device):
        log.warning("deterministic=True: the batch-invariant kernels cannot run on %s (on the CPU they need "
                    "TRITON_INTERPRET=1 set before import), so torch's ops serve and engine/trainer log-probs are "
                    "close but not guaranteed bit-identical", device)
    return invariant_mode
