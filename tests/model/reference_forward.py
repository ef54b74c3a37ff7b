"""An independent forward pass of pdserve's models (docs/model.md,
"Equations") in PyTorch, in float64, from the checkpoint directory alone:
config.json and model.safetensors, read here without pdserve's code. The
hybrid (model_type pdserve_hybrid), and the Hugging Face families
LlamaForCausalLM (with llama3 rope_scaling), Qwen3ForCausalLM (per-head
q/k RMSNorm, explicit head_dim) and GraniteMoeHybridForCausalLM without
experts (layer_types, shared_mlp, the four multipliers, attention without
RoPE unless position_embedding_type is "rope", the Mamba2 gated RMSNorm
over the whole inner width), as the transformers library defines them.

    logits = forward(model_dir, ids, drop_conv_at=None)

returns a [len(ids), vocab] float64 tensor: the logits after each position.
Written from the equations, not from src/model: attention with rotate-half
RoPE and grouped KV heads over the whole sequence at once; Mamba2 as its
recurrence, token by token, with the depthwise causal conv window; gated
group RMSNorm; SwiGLU MLP; pre-norm residuals.

drop_conv_at: a negative control. From that position on, the Mamba conv
window restarts from zeros (the SSM state is kept), as a hand-off that lost
the conv state would; a comparison against pdserve must then fail.
"""
import json
import os
import struct

import torch

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def load_safetensors(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        begin, end = e["data_offsets"]
        t = torch.frombuffer(bytearray(data[begin:end]), dtype=DTYPES[e["dtype"]])
        out[name] = t.reshape(e["shape"]).to(torch.float64)
    return out


def load_checkpoint(model_dir):
    """model.safetensors, or every shard model.safetensors.index.json names."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        return load_safetensors(os.path.join(model_dir, "model.safetensors"))
    out = {}
    for shard in sorted(set(json.load(open(index))["weight_map"].values())):
        out.update(load_safetensors(os.path.join(model_dir, shard)))
    return out


def rms_norm(v, w, eps):
    return v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * w


def silu(v):
    return v * torch.sigmoid(v)


def inv_freq(d, base, scaling):
    """base^(-2i/d), with the llama3 rope_scaling of transformers'
    _compute_llama3_parameters when given."""
    inv = base ** (-2.0 * torch.arange(d // 2, dtype=torch.float64) / d)
    if not scaling:
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    orig = scaling["original_max_position_embeddings"]
    wavelen = 2 * torch.pi / inv
    scaled = torch.where(wavelen > orig / low, inv / factor, inv)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < orig / high) & ~(wavelen > orig / low)
    return torch.where(medium, smoothed, scaled)


def rope(x, positions, base, scaling=None):
    """x: [T, heads, D]; rotate pairs (i, i + D/2) by pos * inv_freq[i]."""
    d = x.shape[-1]
    inv = inv_freq(d, base, scaling)
    ang = positions[:, None].to(torch.float64) * inv[None, :]  # [T, half]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    a, b = x[..., :d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def attention(u, w, pre, cfg):
    T = u.shape[0]
    H, KV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q = (u @ w[pre + "q_proj.weight"].T).reshape(T, H, D)
    k = (u @ w[pre + "k_proj.weight"].T).reshape(T, KV, D)
    v = (u @ w[pre + "v_proj.weight"].T).reshape(T, KV, D)
    if pre + "q_norm.weight" in w:  # Qwen3: each head of q and k, before RoPE
        q = rms_norm(q, w[pre + "q_norm.weight"], cfg["rms_norm_eps"])
        k = rms_norm(k, w[pre + "k_norm.weight"], cfg["rms_norm_eps"])
    pos = torch.arange(T)
    scaling = cfg.get("rope_scaling")
    if cfg.get("position_embedding_type", "rope") == "rope":
        q, k = rope(q, pos, cfg["rope_theta"], scaling), rope(k, pos, cfg["rope_theta"], scaling)
    group = H // KV
    k = k.repeat_interleave(group, dim=1)  # head h uses KV head h // group
    v = v.repeat_interleave(group, dim=1)
    if "attention_multiplier" in cfg:  # Granite: the multiplier replaces 1/sqrt(D)
        scores = torch.einsum("thd,shd->hts", q, k) * cfg["attention_multiplier"]
    else:
        scores = torch.einsum("thd,shd->hts", q, k) / (D ** 0.5)
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(mask[None], float("-inf"))
    out = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v).reshape(T, H * D)
    return out @ w[pre + "o_proj.weight"].T


def mamba(u, w, pre, cfg, drop_conv_at):
    T, dim = u.shape
    d_inner = cfg["mamba_expand"] * dim
    heads, G, N = cfg["mamba_n_heads"], cfg["mamba_n_groups"], cfg["mamba_d_state"]
    P, d_conv = d_inner // heads, cfg["mamba_d_conv"]
    conv_dim = d_inner + 2 * G * N
    proj = u @ w[pre + "in_proj.weight"].T
    z, xbc, dt = proj[:, :d_inner], proj[:, d_inner:d_inner + conv_dim], proj[:, d_inner + conv_dim:]
    conv_w = w[pre + "conv1d.weight"].reshape(conv_dim, d_conv)
    conv_b = w[pre + "conv1d.bias"]
    dt_bias, A = w[pre + "dt_bias"], -torch.exp(w[pre + "A_log"])
    Dskip = w[pre + "D"]
    window = torch.zeros(conv_dim, d_conv, dtype=torch.float64)  # oldest first
    S = torch.zeros(heads, P, N, dtype=torch.float64)
    ys = []
    for t in range(T):
        if drop_conv_at is not None and t == drop_conv_at:
            window = torch.zeros_like(window)
        window = torch.cat([window[:, 1:], xbc[t][:, None]], dim=1)
        c = silu((window * conv_w).sum(-1) + conv_b)
        x = c[:d_inner].reshape(heads, P)
        B = c[d_inner:d_inner + G * N].reshape(G, N)
        C = c[d_inner + G * N:].reshape(G, N)
        g = torch.arange(heads) // (heads // G)
        d = torch.nn.functional.softplus(dt[t] + dt_bias)  # [heads]
        S = S * torch.exp(d * A)[:, None, None] + (d[:, None, None] * B[g][:, None, :]) * x[:, :, None]
        y = (S * C[g][:, None, :]).sum(-1) + Dskip[:, None] * x
        norm_groups = 1 if cfg.get("model_type") == "granitemoehybrid" else G
        gated = (y.reshape(d_inner) * silu(z[t])).reshape(norm_groups, d_inner // norm_groups)
        normed = gated / torch.sqrt((gated * gated).mean(-1, keepdim=True) + cfg["rms_norm_eps"])
        ys.append(normed.reshape(d_inner) * w[pre + "norm.weight"])
    return torch.stack(ys) @ w[pre + "out_proj.weight"].T


def forward(model_dir, ids, drop_conv_at=None):
    cfg = json.load(open(model_dir + "/config.json"))
    w = load_checkpoint(model_dir)
    hf = "architectures" in cfg
    granite = cfg.get("model_type") == "granitemoehybrid"
    if hf:  # transformers' defaults for what a config may leave out
        cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        cfg.setdefault("rope_theta", 10000.0)
        cfg["layer_pattern"] = "A" * cfg["num_hidden_layers"]
    if granite:
        types = cfg.get("layer_types") or ["mamba"] * cfg["num_hidden_layers"]
        cfg["layer_pattern"] = "".join("M" if t == "mamba" else "A" for t in types)
        if cfg.get("position_embedding_type") is None:
            cfg["position_embedding_type"] = "nope"
    eps = cfg["rms_norm_eps"]
    ff_norm = "post_attention_layernorm" if hf else "pre_ff_layernorm"
    res_mult = cfg.get("residual_multiplier", 1.0) if granite else 1.0
    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    if granite:
        x = x * cfg.get("embedding_multiplier", 1.0)
    for layer, kind in enumerate(cfg["layer_pattern"]):
        pre = "model.layers.%d." % layer
        u = rms_norm(x, w[pre + "input_layernorm.weight"], eps)
        if kind == "A":
            h = x + attention(u, w, pre + "self_attn.", cfg) * res_mult
        else:
            h = x + mamba(u, w, pre + "mamba.", cfg, drop_conv_at) * res_mult
        u = rms_norm(h, w[pre + ff_norm + ".weight"], eps)
        if granite:  # shared_mlp: input_linear's first half is the gate
            gate, up = (u @ w[pre + "shared_mlp.input_linear.weight"].T).chunk(2, dim=-1)
            x = h + (silu(gate) * up) @ w[pre + "shared_mlp.output_linear.weight"].T * res_mult
        else:
            mlp = (silu(u @ w[pre + "mlp.gate_proj.weight"].T) * (u @ w[pre + "mlp.up_proj.weight"].T))
            x = h + mlp @ w[pre + "mlp.down_proj.weight"].T
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    logits = rms_norm(x, w["model.norm.weight"], eps) @ head.T
    if granite:
        logits = logits / cfg.get("logits_scaling", 1.0)
    return logits
