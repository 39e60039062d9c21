"""A tiny but complete llama GGUF written with the `gguf` package itself, from tensors the
test chooses (tests/model/test_convert.py and the hostile-file tests build on it)."""
import gguf
import numpy as np

TINY = dict(n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab=40)


def tiny_tensors(seed=0, tied=True, n_layer=TINY["n_layer"], dim=TINY["dim"], n_head=TINY["n_head"],
                 n_kv_head=TINY["n_kv_head"], ffn_dim=TINY["ffn_dim"], vocab=TINY["vocab"]):
    """name -> f32 array shaped (n, k) / (n,), as a llama model has them."""
    rng = np.random.default_rng(seed)
    head_dim = dim // n_head
    shapes = {"token_embd.weight": (vocab, dim), "output_norm.weight": (dim,)}
    if not tied:
        shapes["output.weight"] = (vocab, dim)
    for i in range(n_layer):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (dim,), f"blk.{i}.ffn_norm.weight": (dim,),
            f"blk.{i}.attn_q.weight": (n_head * head_dim, dim),
            f"blk.{i}.attn_k.weight": (n_kv_head * head_dim, dim),
            f"blk.{i}.attn_v.weight": (n_kv_head * head_dim, dim),
            f"blk.{i}.attn_output.weight": (dim, n_head * head_dim),
            f"blk.{i}.ffn_gate.weight": (ffn_dim, dim), f"blk.{i}.ffn_up.weight": (ffn_dim, dim),
            f"blk.{i}.ffn_down.weight": (dim, ffn_dim),
        })
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_gguf(path, tensors, arch="llama", raw_types=None, extra_keys=None, drop_keys=()):
    """A small but complete llama GGUF. ``raw_types``: name -> GGMLQuantizationType for
    tensors given as raw bytes."""
    writer = gguf.GGUFWriter(str(path), arch)
    vocab = TINY["vocab"]
    keys = {
        f"{arch}.block_count": TINY["n_layer"], f"{arch}.embedding_length": TINY["dim"],
        f"{arch}.attention.head_count": TINY["n_head"], f"{arch}.attention.head_count_kv": TINY["n_kv_head"],
        f"{arch}.feed_forward_length": TINY["ffn_dim"], f"{arch}.context_length": 256,
        f"{arch}.rope.dimension_count": TINY["dim"] // TINY["n_head"],
    }
    for key, value in keys.items():
        if key not in drop_keys:
            writer.add_uint32(key, value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list([f"t{i}" for i in range(vocab - 2)] + ["Ġa", "ü"])
    writer.add_token_types([1] * vocab)
    writer.add_token_merges(["t 1", "Ġ a"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{{ messages }}")
    for key, value in (extra_keys or {}).items():
        writer.add_string(key, value)
    for name, array in tensors.items():
        writer.add_tensor(name, array, raw_dtype=(raw_types or {}).get(name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
