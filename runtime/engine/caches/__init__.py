"""Cache layouts beside the paged KV of the engine core, for the architectures that need them: the sliding-window
layers' own block pool (window_kv: gpt-oss) and the per-sequence recurrent state slots with their prefix snapshots
(state_slots: hybrid linear attention, Qwen3-Next). The model runner builds them only for a model that has them.
"""
