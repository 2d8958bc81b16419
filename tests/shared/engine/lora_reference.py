"""LoRA adapters made by PEFT, and greedy continuations through PEFT: the LoRA parity
reference. transformers and peft are test-only dependencies; tests alone import this."""

from __future__ import annotations

from pathlib import Path

import torch

# the modules each architecture's adapters target in the tests (PEFT's regular
# expression over module names): attention and dense MLPs. (On the MoE models PEFT maps
# any gate / up / down target onto transformers' fused routed experts too, so their
# dense and shared-expert MLPs are checked against merged weights instead.)
TARGETS = {
    "llama": r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
    "qwen3": r".*\.(q_proj|v_proj|o_proj|down_proj)",
    "qwen3_moe": r".*\.self_attn\.(q_proj|k_proj|v_proj|o_proj)",
    "deepseek_v3": r".*\.self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)",
    # every projection but the grouped o_a_proj: the attention's, the compressors' and the
    # indexer's, and the shared experts' MLP (DeepSeek-V4's routed experts are no Linear)
    "deepseek_v4": r".*\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|kv_proj|o_b_proj|"
                   r"compressor\.(kv_proj|gate_proj|indexer\.(kv_proj|gate_proj|q_b_proj|"
                   r"scorer\.weights_proj)))|mlp\.shared_experts\.(gate_proj|up_proj|down_proj))",
}


def make_adapters(base: Path, root: Path, arch: str,
                  shapes: list[tuple[int, float, bool]], seed: int,
                  scale: float = 0.3) -> list[Path]:
    """PEFT LoRA adapters of ``base``, one per (r, lora_alpha, rsLoRA) in ``shapes``, with
    random A and B (B scaled by ``scale``, so an adapter changes the greedy text without
    swamping the model), saved under ``root``: their folders, in order."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    names = [f"a{i}" for i in range(len(shapes))]
    peft_model = None
    for name, (r, alpha, rslora) in zip(names, shapes, strict=True):
        cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS[arch],
                         init_lora_weights=False, use_rslora=rslora, lora_dropout=0.0)
        if peft_model is None:
            peft_model = get_peft_model(model, cfg, adapter_name=name)
        else:
            peft_model.add_adapter(name, cfg)
    assert peft_model is not None
    with torch.no_grad():
        for pname, p in peft_model.named_parameters():
            if "lora_B" in pname:
                p.mul_(scale)
    peft_model.save_pretrained(str(root), selected_adapters=names)
    return [root / name for name in names]  # (PEFT writes each under its name)


def peft_greedy(base: Path, adapters: list[Path], jobs: list[tuple[int | None, list[int]]],
                new_tokens: int, stepwise: bool = False) -> list[list[int]]:
    """Greedy continuations, one per (adapter index or None for the base model, prompt)
    job, each adapter applied by PEFT, the whole sequence recomputed each token
    (``stepwise``: every token fed one at a time through transformers' cache, as
    DeepSeek-V4's reference needs, see ``hf_reference.hf_greedy_stepwise``)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(
        str(base), dtype=torch.float32, **({"attn_implementation": "eager"} if stepwise else {}))
    model = PeftModel.from_pretrained(model, str(adapters[0]), adapter_name="0")
    for i, path in enumerate(adapters[1:], start=1):
        model.load_adapter(str(path), adapter_name=str(i))
    model.eval()

    def greedy(prompt: list[int]) -> list[int]:
        seq = list(prompt)
        cache = DynamicCache(config=model.config) if stepwise else None
        fed = 0
        for _ in range(new_tokens):
            if cache is None:
                logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            else:
                for token in seq[fed:]:
                    logits = model(input_ids=torch.tensor([[token]]), cache=cache,
                                   use_cache=True).logits[0, -1]
                fed = len(seq)
            seq.append(int(logits.float().argmax()))
        return seq[len(prompt):]

    outs = []
    with torch.inference_mode():
        for index, prompt in jobs:
            if index is None:
                with model.disable_adapter():
                    outs.append(greedy(prompt))
            else:
                model.set_adapter(str(index))
                outs.append(greedy(prompt))
    return outs
