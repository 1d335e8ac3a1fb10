"""One eager step's host metadata, as every rank of a tensor-parallel group runs it: rank 0's model runner builds
it, sends it packed over the step channel (workers.StepChannel), and every other rank runs the same plan
(ModelRunner.run_plan). Without tensor parallelism it is just the runner's step inputs."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain


@dataclass
class EagerPlan:
    """One eager step's host metadata, as every rank runs it. ids: pending tokens are 0 here (filled on rank 0's
    device, then broadcast); tables: every sequence's block table padded to one width."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    q_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]
    ends: list[int]  # rows whose logits are wanted: the last row of each chunk that completes its sequence
    prompt_rows: dict[int, tuple[int, int]]  # chunk index -> its rows (prompt logprobs)

    def pack(self) -> list[int]:
        """What rank 0 sends: sizes, then the lists (not the ids: those go from its device)."""
        chunks, width = len(self.q_lens), len(self.tables[0])
        rows = list(chain.from_iterable((i, a, b) for i, (a, b) in self.prompt_rows.items()))
        return [chunks, len(self.positions), width, len(self.ends), len(self.prompt_rows), *self.positions,
                *self.slots, *self.q_lens, *self.seq_lens, *chain.from_iterable(self.tables), *self.ends,
                *rows]  # fmt: skip

    @classmethod
    def unpack(cls, data: list[int]) -> EagerPlan:
        chunks, tokens, width, ends, prompts = data[:5]
        at = 5

        def take(n: int) -> list[int]:
            nonlocal at
            at += n
            return data[at - n : at]

        positions, slots, q_lens, seq_lens = take(tokens), take(tokens), take(chunks), take(chunks)
        flat = take(chunks * width)
        tables = [flat[i * width : (i + 1) * width] for i in range(chunks)]
        end_rows, rows = take(ends), take(3 * prompts)
        prompt_rows = {rows[j]: (rows[j + 1], rows[j + 2]) for j in range(0, len(rows), 3)}
        return cls([0] * tokens, positions, slots, q_lens, seq_lens, tables, end_rows, prompt_rows)
