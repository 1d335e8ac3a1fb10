"""Host lists into device tensors without waiting for the device's queue: the step inputs every runner builds."""

from __future__ import annotations

import torch


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor without waiting for the device's queue (a blocking copy from pageable
    memory would first drain the stream, and with it the overlap of host and device work)."""
    t = torch.tensor(values, dtype=dtype)
    return t.to(device, non_blocking=True) if device.type != "cpu" else t


def fill_pending(input_ids: torch.Tensor, rows: list[int], src_rows: list[int], src: torch.Tensor) -> None:
    """input_ids[rows] = src[src_rows], on the device: tokens the previous step sampled that the host has not read
    (overlapped scheduling). The steady state, the same decode batch as the last step in the same order, is one
    copy."""
    if rows == src_rows == list(range(len(rows))):
        input_ids[:len(rows)].copy_(src[:len(rows)])
    else:
        dev = input_ids.device
        input_ids.index_copy_(0, upload(rows, torch.int64, dev),
                              src.index_select(0, upload(src_rows, torch.int64, dev)))
