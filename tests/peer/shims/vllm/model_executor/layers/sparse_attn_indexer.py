import torch


def as_fp32_logits(logits: torch.Tensor, row_ends: torch.Tensor) -> torch.Tensor:
    """bf16 logits widened to fp32 in a tensor of the same strides (fp32 logits as they are)."""
    if logits.dtype == torch.float32:
        return logits
    out = torch.empty_strided(logits.shape, logits.stride(), dtype=torch.float32, device=logits.device)
    return out.copy_(logits)
