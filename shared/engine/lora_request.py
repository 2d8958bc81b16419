"""The LoRA adapter a request runs, as vLLM's ``vllm.lora.request.LoRARequest`` (no
torch here: the engine protocol's edge imports it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: its name, a positive id, and its folder (PEFT's format)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name: required")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be positive, got {self.lora_int_id}")
