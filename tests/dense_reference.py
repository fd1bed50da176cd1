"""The oracle: span semantics computed densely in float64 — no paging, no cache, no deltas.

A plus piece's K/V are its standalone encoding (anchor tokens then the piece, causal, at local
positions), with K re-rotated to the piece's logical positions; every other token is computed
in one causal pass over the whole prompt at logical positions, reading those fixed K/V."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from spanserve.engine.layout import Piece
from spanserve.model.config import ModelConfig
from spanserve.rope import rope_inv_freq


class Dense:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float64):
        self.c = config
        self.dtype = dtype  # float64 for the oracle; float32 for studies of a real model
        self.w = {k: v.to(dtype) for k, v in weights.items()}
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling).to(dtype)

    def _norm(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c.rms_norm_eps))

    def _rope(self, x, pos):  # x [N, heads, D]
        ang = pos.to(self.dtype)[:, None] * self.inv_freq[None]
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def layer(self, i, h, pos, mask, override=None, repair=None):
        """Decoder layer i over hidden states h [N, hidden] at positions pos with mask [N, N].
        override(k, v) may replace K/V (before RoPE) ahead of attention. repair: (context [N, N]
        bool, temperature, log_scale): each query reads its context keys as one group (APE),
        written out here on its own: weights softmax(s / T) within, the group one key of logit
        T * logsumexp(s / T) + log_scale beside the others.
        Returns (h, k, v, probs [H, N, N])."""
        c, w = self.c, self.w
        H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
        N = h.shape[0]
        p = f"model.layers.{i}."
        a = p + "self_attn."
        x = self._norm(h, w[p + "input_layernorm.weight"])
        q = F.linear(x, w[a + "q_proj.weight"], w.get(a + "q_proj.bias")).view(N, H, D)
        k = F.linear(x, w[a + "k_proj.weight"], w.get(a + "k_proj.bias")).view(N, KVH, D)
        v = F.linear(x, w[a + "v_proj.weight"], w.get(a + "v_proj.bias")).view(N, KVH, D)
        if c.qk_norm:
            q, k = self._norm(q, w[a + "q_norm.weight"]), self._norm(k, w[a + "k_norm.weight"])
        if override is not None:
            k, v = override(k, v)
        kr = self._rope(k, pos).repeat_interleave(H // KVH, dim=1)
        vv = v.repeat_interleave(H // KVH, dim=1)
        scores = torch.einsum("qhd,khd->hqk", self._rope(q, pos), kr) / D ** 0.5
        if repair is None:
            probs = scores.masked_fill(~mask[None], float("-inf")).softmax(-1)
        else:
            probs = _grouped(scores, mask, *repair)
        o = torch.einsum("hqk,khd->qhd", probs, vv).reshape(N, H * D)
        h = h + F.linear(o, w[a + "o_proj.weight"])
        x = self._norm(h, w[p + "post_attention_layernorm.weight"])
        h = h + F.linear(F.silu(F.linear(x, w[p + "mlp.gate_proj.weight"])) * F.linear(x, w[p + "mlp.up_proj.weight"]),
                         w[p + "mlp.down_proj.weight"])
        return h, k, v, probs

    def forward(self, tokens, positions, mask, fixed=None, repair=None):
        """tokens/positions [N]; mask [N, N] bool (query row sees key column); fixed: layer ->
        (k_raw [N, KVH, D] before RoPE, v, which [N] bool) overriding those positions' K/V;
        repair: as `layer` takes it, in every layer.
        Returns (final hidden [N, hidden], per-layer (k_raw, v))."""
        h = self.w["model.embed_tokens.weight"][torch.tensor(tokens)]
        pos = torch.tensor(positions)
        kvs = []
        for i in range(self.c.num_layers):
            override = None
            if fixed is not None:
                fk, fv, which = fixed[i]

                def override(k, v, fk=fk, fv=fv, which=which):
                    return torch.where(which[:, None, None], fk, k), torch.where(which[:, None, None], fv, v)
            h, k, v, _ = self.layer(i, h, pos, mask, override, repair)
            kvs.append((k, v))
        return self._norm(h, self.w["model.norm.weight"]), kvs

    def logits(self, hidden):
        head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        return F.linear(hidden, head)

    def span_logits(self, pieces: list[Piece], generated: list[int] = (), temperature: float = 1.0,
                    log_scale: float = 0.0) -> torch.Tensor:
        """Logits of the last token of prompt + generated under span semantics; temperature and
        log_scale: the repair of the plus pieces' scores read by tokens after them."""
        tokens = [t for p in pieces for t in p.tokens] + list(generated)
        N = len(tokens)
        causal = torch.ones(N, N, dtype=torch.bool).tril()
        c = self.c
        fk = [torch.zeros(N, c.num_kv_heads, c.head_dim, dtype=self.dtype) for _ in range(c.num_layers)]
        fv = [torch.zeros_like(x) for x in fk]
        which = torch.zeros(N, dtype=torch.bool)
        for p in pieces:
            if p.kind != "plus":
                continue
            a, L = p.anchor_len, len(p.tokens)
            local = tokens[:a] + list(p.tokens)
            _, kvs = self.forward(local, list(range(a + L)), torch.ones(a + L, a + L, dtype=torch.bool).tril())
            for i, (k, v) in enumerate(kvs):
                fk[i][p.start:p.end] = k[a:]
                fv[i][p.start:p.end] = v[a:]
            which[p.start:p.end] = True
        hidden, _ = self.forward(tokens, list(range(N)), causal, [(fk[i], fv[i], which) for i in range(c.num_layers)],
                                 repaired(pieces, N, temperature, log_scale))
        return self.logits(hidden[-1])




def _grouped(scores, mask, context, temperature, log_scale):
    """APE's reading of the context keys, per query row, in the plainest form: the group's
    logsumexp, each member's share of it, the group as one extra key."""
    H, N, _ = scores.shape
    probs = torch.zeros_like(scores)
    for i in range(N):
        vis = mask[i]
        ctx = vis & context[i]
        rest = vis & ~ctx
        s = scores[:, i]
        group_logit = torch.full((H,), float("-inf"), dtype=scores.dtype)
        within = torch.zeros_like(s)
        if ctx.any():
            sc = s[:, ctx] / temperature
            group_logit = temperature * torch.logsumexp(sc, -1) + log_scale
            within[:, ctx] = sc.softmax(-1)
        logits = torch.cat([s[:, rest], group_logit[:, None]], -1).softmax(-1)
        probs[:, i, rest] = logits[:, :-1]
        probs[:, i] += logits[:, -1:] * within
    return probs


def repaired(pieces: list[Piece], N: int, temperature: float, log_scale: float):
    """The repair as `Dense.layer` takes it: the scores of each plus piece's keys read by queries at
    or after the piece's end (None when the values change nothing)."""
    if temperature == 1.0 and log_scale == 0.0:
        return None
    changed = torch.zeros(N, N, dtype=torch.bool)
    for p in pieces:
        if p.kind == "plus":
            changed[p.end:, p.start:p.end] = True
    return changed, temperature, log_scale


def policy_logits(dense: Dense, pieces: list[Piece], policy, block_size: int, observe=None) -> torch.Tensor:
    """Logits of the last prompt token under a selective policy, computed plainly: every token's
    hidden state at every layer, with reused tokens that are not recomputed at a layer reading
    their standalone K/V there. Mirrors the policy definitions in spanserve.reuse.policies.
    observe(layer, probs [H, N, N], k, v, recomputed [N] bool, reused [N] bool, standalone (k, v)),
    if given, sees every layer (k before RoPE)."""
    from spanserve.reuse.policies import CacheBlend, Sinks, SparseQ, top_with_sinks

    c, w = dense.c, dense.w
    H, KVH, D = c.num_heads, c.num_kv_heads, c.head_dim
    tokens = [t for p in pieces for t in p.tokens]
    N = len(tokens)
    first_plus = min((p.start for p in pieces if p.kind == "plus"), default=N)
    reused = torch.zeros(N, dtype=torch.bool)
    sinks = torch.zeros(N, dtype=torch.bool)  # the first sink_tokens of every reused segment
    fk = [torch.zeros(N, KVH, D, dtype=dense.dtype) for _ in range(c.num_layers)]
    fv = [torch.zeros_like(x) for x in fk]
    for p in pieces:
        if p.kind != "plus":
            continue
        a, L = p.anchor_len, len(p.tokens)
        _, kvs = dense.forward(tokens[:a] + list(p.tokens), list(range(a + L)), torch.ones(a + L, a + L, dtype=torch.bool).tril())
        for i, (k, v) in enumerate(kvs):
            fk[i][p.start:p.end], fv[i][p.start:p.end] = k[a:], v[a:]
        reused[p.start:p.end] = True
        sinks[p.start:p.start + min(policy.sink_tokens, L)] = True
    decision = policy.decision_layer(c.num_layers)
    recomputed = reused.clone()  # reused tokens recomputed at the current layer
    pos = torch.arange(N)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    repair = repaired(pieces, N, policy.temperature, policy.log_scale)
    h = w["model.embed_tokens.weight"][torch.tensor(tokens)]
    for i in range(c.num_layers):
        stale = reused & ~recomputed

        def override(k, v, i=i, stale=stale):
            return torch.where(stale[:, None, None], fk[i], k), torch.where(stale[:, None, None], fv[i], v)
        h, k, v, probs = dense.layer(i, h, pos, causal, override, repair)
        if observe is not None:
            observe(i, probs, k, v, recomputed & reused, reused, (fk[i], fv[i]))
        if i == decision:
            idx = reused.nonzero().flatten()
            if isinstance(policy, Sinks):
                keep = set(idx[sinks[idx]].tolist())
            elif isinstance(policy, CacheBlend):
                dev = ((k - fk[i]).pow(2).sum((1, 2)) + (v - fv[i]).pow(2).sum((1, 2)))[idx]
                chosen = top_with_sinks(dev, sinks[idx], round(policy.ratio * idx.numel()))
                keep = set(idx[chosen].tolist())
            elif isinstance(policy, SparseQ):
                asking = (~reused) & (pos >= first_plus)
                keep = set(policy.select(probs[:, asking].sum((0, 1)), reused, block_size, sinks).tolist())
            else:
                raise TypeError(policy)
            recomputed = torch.tensor([j in keep for j in range(N)], dtype=torch.bool)
    return dense.logits(dense._norm(h, w["model.norm.weight"])[-1])
