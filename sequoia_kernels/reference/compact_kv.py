import torch


def compact_kv_reference(
    cache: torch.Tensor,  # [N, B, H, S, D]
    src_pos: torch.Tensor,  # [B, M]
    dst_start: torch.Tensor,  # [B]
    num_accepted: torch.Tensor,  # [B]
) -> None:
    """cache[:, b, :, dst_start[b] + i] := old cache[:, b, :, src_pos[b, i]] for i < num_accepted[b].

    Reads all source rows of a batch row before writing any (a snapshot), so overlapping
    sources and destinations are handled by construction.
    """
    for b in range(cache.shape[1]):
        n = int(num_accepted[b])
        if n == 0:
            continue
        d = int(dst_start[b])
        rows = cache[:, b, :, src_pos[b, :n].long()].clone()  # [N, H, n, D]
        cache[:, b, :, d : d + n] = rows
