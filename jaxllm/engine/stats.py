"""An engine's counters: what /metrics exports and the benchmarks' memory report read."""
from __future__ import annotations


class EngineStats:
    def __init__(self, scheduler, kv_manager, block_size: int, max_model_len: int, lora=None):
        """lora: the engine's LoRAManager, or None."""
        self.scheduler = scheduler
        self.kv_manager = kv_manager
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.lora = lora
        self.kv_slot_steps = 0            # memory accounting, summed over steps
        self.kv_waste_slot_steps = 0
        self.peak_running = 0
        self.num_failed_steps = 0         # steps that raised (jaxllm.engine.faults)
        self.num_failed_requests = 0      # requests those steps ended with "error"
        self.num_device_state_resets = 0  # failures that took the KV cache with them

    @property
    def kv_total_slots(self) -> int:
        return self.kv_manager.pool.num_usable_blocks * self.block_size

    def account_step(self) -> None:
        """KV slots held by running requests against slots holding a token, once per step.
        Shared (prefix-cached or forked) blocks are full, so a block's empty slots belong
        to the one request whose table ends in it."""
        kv, bs = self.kv_manager, self.block_size
        running = self.scheduler.running
        if not running:
            return
        allocated = (kv.pool.num_usable_blocks - kv.num_free_blocks) * bs
        blocks = kv.req_to_blocks
        waste = (sum(len(blocks.get(r.request_id, ())) for r in running) * bs
                 - sum(r.num_computed_tokens for r in running))
        self.kv_slot_steps += allocated
        self.kv_waste_slot_steps += min(max(waste, 0), allocated)
        self.peak_running = max(self.peak_running, len(running))

    def memory_report(self) -> dict:
        """Waste of allocated KV slots over the run so far, peak concurrency, and what static
        max-length preallocation would have admitted with the same memory."""
        total = self.kv_total_slots
        waste = self.kv_waste_slot_steps / self.kv_slot_steps if self.kv_slot_steps else 0.0
        return {"kv_total_slots": total, "kv_waste_perc": 100.0 * waste,
                "peak_running_seqs": self.peak_running,
                "static_prealloc_seqs": total // self.max_model_len,
                "max_model_len": self.max_model_len}

    def snapshot(self) -> dict:
        """The scheduler and cache counters (what /metrics exports)."""
        sched, kv = self.scheduler, self.kv_manager
        lora = self.lora.stats(sched.requests.values()) if self.lora is not None else {}
        return {
            "num_requests_running": sched.num_running,
            "num_requests_waiting": sched.num_waiting,
            "kv_cache_usage_perc": kv.usage(),
            "num_preemptions": sched.num_preemptions,
            "num_swaps": sched.num_swaps,
            "prefix_cache_queries": kv.prefix_queries,
            "prefix_cache_hits": kv.prefix_hits,
            "prompt_tokens": sched.num_prompt_tokens,
            "generation_tokens": sched.num_generation_tokens,
            "kv_slot_steps": self.kv_slot_steps,
            "kv_waste_slot_steps": self.kv_waste_slot_steps,
            "peak_running": self.peak_running,
            "kv_total_slots": self.kv_total_slots,
            "num_failed_steps": self.num_failed_steps,
            "num_failed_requests": self.num_failed_requests,
            "num_device_state_resets": self.num_device_state_resets,
            **lora,
            # speculative decoding (vLLM's counters): verifications, proposed and accepted tokens
            "spec_decode_num_drafts": sched.spec_num_drafts,
            "spec_decode_num_draft_tokens": sched.spec_num_draft_tokens,
            "spec_decode_num_accepted_tokens": sched.spec_num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(sched.spec_accepted_per_pos),
        }
