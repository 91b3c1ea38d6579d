"""TEST DOUBLE of apex.optimizers (see tests/doubles/README.md): FusedAdam's constructor and its
update in plain torch, as apex's multi-tensor kernel computes it in AdamW mode (adam_w_mode=True):
m_hat / (sqrt(v_hat) + eps) + weight_decay * p, times lr, subtracted from p. Like apex it keeps
one step count per param group (``group["step"]``, an int) and per parameter only ``exp_avg`` and
``exp_avg_sq`` (fp32)."""

import torch


class FusedAdam(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True, capturable=False, use_master=False):
        if amsgrad or capturable or use_master:
            raise NotImplementedError("the apex test double implements the plain FusedAdam only")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            bc1 = 1 - beta1 ** group["step"] if group["bias_correction"] else 1.0
            bc2 = 1 - beta2 ** group["step"] if group["bias_correction"] else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                    raise RuntimeError("FusedAdam only support fp16 and fp32.")
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p).float()
                    state["exp_avg_sq"] = torch.zeros_like(p).float()
                g, m, v = p.grad.float(), state["exp_avg"], state["exp_avg_sq"]
                if not self.adam_w_mode:
                    g = g + group["weight_decay"] * p.float()
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / bc1) / ((v / bc2).sqrt() + group["eps"])
                if self.adam_w_mode:
                    update = update + group["weight_decay"] * p.float()
                p.copy_(p.float() - group["lr"] * update)
        return loss
