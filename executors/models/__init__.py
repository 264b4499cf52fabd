"""Model code: one decoder-only implementation serving Qwen3, Llama (SmolLM2) and Qwen2 by flags."""
