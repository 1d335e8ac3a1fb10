"""The MTP drafter (draft_model "mtp"): the target's multi-token-prediction module (DeepSeek-V3's, models/deepseek.py
DeepseekMTP; Qwen3-Next's, models/qwen3_next.py Qwen3NextMTP) drafts k tokens from the target's own last hidden
states (after the final norm).

Its cache is one layer of its own (DeepSeek: latent rows; Qwen3-Next: K/V) over the target's blocks (as a draft
model's). The row at position p needs the target's state h_p and the token at p+1; it is written once both are
known, so per row of SpecDecoder.hist one state waits on the device (`hidden`, at `start`, if `pending`): the newest
position's. A verify step (`record`) writes its rows before the last accepted one (their next tokens: the accepted
drafts); a plain step (`absorb`: prompt chunks, decodes, eager or from a decode graph) writes a decode's waiting row
(its next token: the one fed now) and every row whose next token the host knows. A draft pass (`propose`; static
shapes, a CUDA graph of its own) is k single-row steps: the first writes the waiting row with the newest token and
gives draft 1, the next ones feed the module's own hidden and draft (rewritten once verified). A row with no state
waiting at len-2 (its hist row was taken) drafts nothing: lower acceptance, never other tokens.
"""

from __future__ import annotations

import torch

from envex.kernels.ops import AttentionMetadata
from envex.runtime.engine.config import MTP
from envex.runtime.engine.device import fill_pending, upload
from envex.runtime.engine.scheduler import ScheduledChunk
from envex.runtime.engine.spec.drafters import DraftModelDrafter, SpecInputs
from envex.runtime.loader import LoadedModel
from envex.runtime.models import dummy_weights
from envex.runtime.packed_load import load_mtp_weights


class MtpDrafter(DraftModelDrafter):
    """Drafts with the target's MTP module over the target runner's ops, rotary tables and blocks (module docstring);
    a draft model's metadata and slots (DraftModelDrafter), nothing to catch up (absorb keeps it current)."""

    name = MTP
    wants_hidden = True

    def __init__(self, runner, loaded: LoadedModel, *, rows: int, max_k: int) -> None:  # runner: the target's
        super().__init__(runner, max_num_batched_tokens=0)  # load_draft checked the model has an MTP module
        with torch.no_grad():
            self.module = runner.model.multi_token_predictor()
            if runner.config.load_format == "dummy":
                dummy_weights(self.module, runner.config.seed + 1)
            else:
                load_mtp_weights(self.module, loaded, runner.device)  # a quantized checkpoint's as the model's
        dev, dtype = runner.device, runner.dtype
        self.ops = runner.ops
        self.kv_cache = self.module.make_kv_cache(runner.num_blocks, self.block_size, dtype, dev)
        self.hidden = torch.zeros(rows, loaded.config.hidden_size, dtype=dtype, device=dev)
        self.start = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.pending = torch.zeros(rows, dtype=torch.bool, device=dev)

    def catch_up(self, seqs: list) -> None:  # absorb and record keep the module's cache current
        return None

    def propose(self, x: SpecInputs) -> None:
        lens, last = x.seq_lens, self.max_model_len - 1
        fresh = (x.k_limit >= 0) & self.pending[x.rows] & (self.start[x.rows] == lens - 2)  # [B] a state at len-2
        hid, token = self.hidden[x.rows], x.hist[x.rows, (lens - 1).clamp(min=0)]  # [B, H], [B] the newest token
        for i in range(x.k):  # draft i+1 from the token at len-1+i and the state at len-2+i (the target's, then own)
            p = (lens - 2 + i).clamp(0, last)
            write = fresh & ((i == 0) | (i < x.k_limit)) & (lens - 2 + i <= last)
            meta = self._meta(p, self._slots(x, p[:, None], write[:, None])[:, 0], x, 1, None)
            logits, hid = self.module.compute_logits(self.ops, *self.module(self.ops, token, hid, self.kv_cache, meta))
            token = logits.argmax(dim=-1)
            x.drafts[:, i] = token
        x.num_drafts.copy_(torch.where(fresh, x.k_limit.clamp(min=0), 0))

    def record(self, x: SpecInputs, hidden: torch.Tensor, accepted: torch.Tensor) -> None:
        """After a verify step, on the device: hidden [B' (K+1), H] the target's states of its rows (B' >= B:
        padding rows); a sequence's rows 0..a-1 (a accepted drafts: its next tokens) are written, row a waits."""
        b, k, dev = accepted.shape[0], x.k, accepted.device
        states = hidden.view(x.batch, k + 1, -1)  # [B', K+1, H]
        acc = torch.zeros_like(x.rows)
        acc[:b] = accepted  # padding rows accept nothing
        lens, rows = x.seq_lens, x.rows
        pos = (lens - 1)[:, None] + torch.arange(k, device=dev)[None, :]  # [B', K]
        write = torch.arange(k, device=dev)[None, :] < acc[:, None]
        meta = self._meta(pos.clamp(max=self.max_model_len - 1).reshape(-1), self._slots(
            x, pos.clamp(max=self.max_model_len - 1), write).reshape(-1), x, k, (lens - 1 + k).to(torch.int32))
        self.module(self.ops, x.drafts.reshape(-1), states[:, :k].reshape(x.batch * k, -1), self.kv_cache, meta)
        self.hidden[rows[:b]] = states[torch.arange(b, device=dev), accepted]
        self.start[rows[:b]], self.pending[rows[:b]] = lens[:b] - 1 + accepted, True

    def absorb(self, chunks: list[ScheduledChunk], rows: list[int | None], hidden: torch.Tensor,
               pending_tokens: torch.Tensor | None) -> None:  # fmt: skip
        """After a plain step: hidden [T, H] the target's states of all its rows, chunk by chunk; rows: each chunk's
        row of hist (None: not drafted for); pending_tokens: ModelRunner.execute's. Writes a decode chunk's waiting
        row (if a state waits at the position before; its next token is the one fed now, read from pending_tokens
        if the host has not yet) and every row whose next token the host knows; the chunk's last row waits."""
        ids, slots, src, positions, q_lens, tables = [], [], [], [], [], []  # type: ignore[var-annotated]
        waits, fill_at, fill_from = [], [], []  # type: ignore[var-annotated]  # waits: (packed row, hist row, pos)
        last_rows, last_src, last_pos = [], [], []  # type: ignore[var-annotated]  # lists of ints
        offset, bs, total = 0, self.block_size, hidden.shape[0]
        for c, row in zip(chunks, rows, strict=True):
            if row is not None:
                tokens, table = c.seq.all_token_ids, c.seq.block_table
                first = c.start - 1 if c.start >= len(c.seq.prompt_token_ids) else c.start  # a decode: its wait row
                end = max(c.start, min(c.start + c.num_tokens, len(tokens) - 1))  # rows before end: next token known
                if first < c.start:
                    if c.start >= len(tokens):  # the token fed now is still on the device
                        fill_at.append(len(ids))
                        fill_from.append(c.seq.pending_row)
                    waits.append((len(ids), row, first))
                    ids.append(tokens[c.start] if c.start < len(tokens) else 0)
                ids += tokens[c.start + 1 : end + 1]
                slots += [table[p // bs] * bs + p % bs for p in range(first, end)]
                src += [total + len(waits) - 1] * (first < c.start) + list(range(offset, offset + end - c.start))
                positions += range(first, end)
                if end > first:
                    q_lens.append(end - first)
                    tables.append(table)
                last_rows.append(row)
                last_src.append(offset + c.num_tokens - 1)
                last_pos.append(c.start + c.num_tokens - 1)
            offset += c.num_tokens
        dev = hidden.device
        if ids:
            slot_t, ids_t = upload(slots, torch.int64, dev), upload(ids, torch.int64, dev)
            if fill_at:
                assert pending_tokens is not None, "a pending token without its source tensor"
                fill_pending(ids_t, fill_at, fill_from, pending_tokens)
            if waits:  # written only where that state waits there
                at, wait_rows, wait_pos = (upload([w[i] for w in waits], torch.int64, dev) for i in range(3))
                ok = self.pending[wait_rows] & (self.start[wait_rows] == wait_pos)
                slot_t[at] = torch.where(ok, slot_t[at], -1)
                hidden = torch.cat([hidden, self.hidden[wait_rows]])
            seq_lens = [positions[sum(q_lens[: i + 1]) - 1] + 1 for i in range(len(q_lens))]
            width = max(len(t) for t in tables)
            meta = AttentionMetadata(
                positions=upload(positions, torch.int64, dev), slot_mapping=slot_t,
                cu_seqlens_q=upload([sum(q_lens[:i]) for i in range(len(q_lens) + 1)], torch.int32, dev),
                block_tables=upload([t + [0] * (width - len(t)) for t in tables], torch.int32, dev),
                cos=self.runner.cos, sin=self.runner.sin, max_q_len=max(q_lens), max_seq_len=max(seq_lens),
                seq_lens=upload(seq_lens, torch.int32, dev), q_lens_host=q_lens, seq_lens_host=seq_lens,
            )  # fmt: skip
            self.module(self.ops, ids_t, hidden[upload(src, torch.int64, dev)], self.kv_cache, meta)
        if last_rows:
            at = upload(last_rows, torch.int64, dev)
            self.hidden[at] = hidden[upload(last_src, torch.int64, dev)]
            self.start[at], self.pending[at] = upload(last_pos, torch.int64, dev), True
