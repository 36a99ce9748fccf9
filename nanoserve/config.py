"""EngineConfig: one frozen, validated description of how the engine runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoserve.speculative import SpeculativeConfig

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_KV_CACHE_DTYPES = (*_DTYPES, "q8_0", "q4_0")  # and llama.cpp's blocks of 32 (nanoserve.model.kv_quant)
_QUANTIZATIONS = ("auto", "int8", "int4", None)
_KERNELS = ("auto", "torch", "blockdot")


@dataclass(frozen=True)
class PlanOverrides:
    """The execution plan's choices an experiment may pin (benchmarks/abbench.py measures one against
    another); each default leaves its choice to the plan (nanoserve.model.plan), which Engine.plan
    holds and `nanoserve plan` prints."""

    pack_weights: bool = True  # CPU: dense matmul weights reordered once for oneDNN where it takes them (not with compile)
    # A quantized linear runs its kernels up to this many rows and the dense matrix in the dtype
    # above it (the kernels are shaped for few rows: benchmarks/matmulbench.py --quant); None: the
    # kernels at every width (slow prefill); "auto": the widest of 16, 32, 64 the start-up probe
    # times blockdot no slower than the dense path at, 8 where it loses at 16 (precision.WIDE_ROWS).
    max_kernel_rows: int | str | None = "auto"
    # Past max_kernel_rows, a quantized linear on blockdot multiplies by its matrix dequantized for
    # that call (False: in C, bit for bit; a pass over the weights per wide step), or by a dense copy
    # held for the model's life (True: 4 bytes a weight in float32, 2 in bf16, Engine.memory()'s
    # dense_copies). "auto": no copies where the start-up probe times blockdot within 1.3x of the
    # dequantized matmul at 16 rows, copies where dense matmuls are faster at decode widths
    # (precision.resolve). Linears on torch's kernels always keep theirs.
    dense_copies: bool | str = "auto"
    # Who runs those few-row passes on a CPU: "torch" (its weight-only kernels), "blockdot"
    # (nanoserve's own, nanoserve/model/blockdot.c, compiled at first use: twelve GGUF kinds and
    # nanoserve's int4, read exactly as stored; docs/cpu-kernels.md lists them), or "auto": blockdot
    # unless the start-up probe times torch's int4 kernel 1.3x faster at one row
    # (precision.BLOCKDOT_MARGIN). Tensor-parallel ranks run blockdot on the batch-invariant plan and
    # torch's kernels off it.
    kernels: str = "auto"
    # Who runs the dense matmuls (float32 or bf16 matrices) on a CPU: "torch" (F.linear, on
    # oneDNN's packed matrices; the one-call decode reads a copy of each in blockdot's dense panels),
    # "blockdot" (the matrices themselves regrouped once into blockdot's dense panels, 16 output rows
    # a panel, k-major, and run there at every width: one copy of each), or "auto": blockdot where
    # the start-up probe times its dense panels no slower than torch's matmul at 64 rows
    # (precision.DENSE_ROWS). Tensor-parallel ranks run dense panels on the batch-invariant plan and
    # torch's matmuls off it.
    dense_kernel: str = "auto"
    # From this many rows of a step, blockdot rounds each block of 32 activations to int16 against
    # its largest value and sums in integers (AVX-512 VNNI's vpdpwssd, or vpmaddwd): 1.1-1.5x the
    # float32 path's speed, within x's rounding (amax / 65534 a block; quantbench: the same KL against
    # float32). None: float32 at every row count.
    blockdot_int16_rows: int | None = 1
    # Q4_K, Q6_K and IQ4_XS matrices (most of a Q4_K_M or IQ4_XS file), and IQ4_NL, Q5_0, Q5_1 and Q8_0
    # ones (a small model's 576-wide matrices in such a file; blockdot.INT8_CHOSEN), on blockdot's file-bit
    # panels: the file's bits (4.75, 6.625 and 4.375 a weight; the 32-weight kinds' exactly), x rounded to
    # int8 per block of 32 and summed in integers (VNNI's vpdpbusd, or vpmaddubsw and vpmaddwd), as
    # llama.cpp multiplies them. False: blockdot's wider panels (6, 9 and 10 bits a weight) on the int16
    # or float32 path above, x rounded 256 times finer.
    blockdot_int8: bool = True
    # Those file-bit panels on AMX tiles (Sapphire Rapids and later, where Linux grants them) from
    # the row count the start-up probe times them faster than the vector tiles at
    # (precision.AMX_ROWS): the same int32 sums and float steps, so no number changes. An int: from
    # that many rows; False: never; "auto": the probe's choice (never where the CPU has no tiles).
    blockdot_amx_rows: int | bool | str = "auto"
    # Decode-only steps run their glue in C (nanoserve/model/fused_decode.c) for Llama, Mistral and
    # Qwen2/3 layers: every layer in one call up to the plan's one-call width where every matmul has a
    # C form (blockdot's panels, or dense panels), three calls a layer between the weights' own linears
    # otherwise. "auto": on, except on the exact path (dtype="float32", quantization=None), which runs
    # torch's ops only; True asks for it there too; False keeps decoder_layer (to compare, or to profile
    # per operation). compile keeps decoder_layer; tensor-parallel ranks keep it off the
    # batch-invariant plan, whose ranks run three C calls a layer between their matmuls.
    fused_decode: bool | str = "auto"

    def __post_init__(self) -> None:
        amx = self.blockdot_amx_rows
        if amx is not False and amx != "auto" and (isinstance(amx, bool) or not isinstance(amx, int) or amx < 1):
            raise ValueError(f"blockdot_amx_rows={self.blockdot_amx_rows!r} is a row count of at least 1, False or 'auto'")
        if self.kernels not in _KERNELS:
            raise ValueError(f"kernels={self.kernels!r} is not one of {list(_KERNELS)}")
        if self.dense_kernel not in _KERNELS:
            raise ValueError(f"dense_kernel={self.dense_kernel!r} is not one of {list(_KERNELS)}")
        if self.max_kernel_rows not in (None, "auto") and (not isinstance(self.max_kernel_rows, int)
                                                           or self.max_kernel_rows < 1):
            raise ValueError(f"max_kernel_rows={self.max_kernel_rows!r} must be None, 'auto' or an integer >= 1")
        if not (isinstance(self.dense_copies, bool) or self.dense_copies == "auto"):
            raise ValueError(f"dense_copies={self.dense_copies!r} must be True, False or 'auto'")
        if self.blockdot_int16_rows is not None and (not isinstance(self.blockdot_int16_rows, int)
                                                    or self.blockdot_int16_rows < 1):
            raise ValueError(f"blockdot_int16_rows={self.blockdot_int16_rows!r} must be None or an integer >= 1")
        if not (isinstance(self.fused_decode, bool) or self.fused_decode == "auto"):
            raise ValueError(f"fused_decode={self.fused_decode!r} must be True, False or 'auto'")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs. Values discovered at run time (how many KV blocks fit) are
    returned by the engine, never written back here.

    What a user chooses: dtype, quantization, kv_cache_dtype (and the scheduling fields); what the
    execution plan decides from them and the probe, an experiment may pin in `overrides`."""

    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 512 * 2**20  # budget used when num_kv_blocks is None
    max_num_seqs: int = 16  # slots: requests running at once
    max_num_batched_tokens: int = 2048  # tokens forwarded in one step (prefill chunks + decodes)
    max_model_len: int | None = None  # prompt + output limit; None: the model's max positions
    enable_chunked_prefill: bool = True  # a prompt longer than the token budget is split over steps
    enable_prefix_caching: bool = True  # full blocks shared by hash between requests with one prefix
    deferred_output: bool = False  # resolve step N's tokens after step N+1 is launched (one token overshoot)
    # Decode rows are split into up to four groups of similar context length, each attended without
    # padding to the longest, from this many rows (abbench --change groups: 0.77x step time at 16
    # slots, 0.75x at 32, 1.13x at 4); None never splits.
    decode_group_min_rows: int | None = 8
    compile: bool = False  # torch.compile the decoder layer (warm-up: Engine.warmup() reports the cost)
    # "auto": bfloat16 where the device computes it faster than float32 (a CUDA device with bf16;
    # on a CPU, a start-up probe decides), float32 elsewhere. Engine.plan says why.
    dtype: str = "auto"
    # Weight-only quantization: None (dense in dtype), "int8" (per output channel), "int4" (groups of
    # 32, scale and zero; the head in int8), "auto" (a checkpoint's own quantization kept where its
    # kernel outruns the dense matmul, dense otherwise).
    quantization: str | None = "auto"
    # The K/V cache's dtype: "float32", "bfloat16", "float16" (2 bytes a value: llama.cpp's default;
    # the same memory holds twice float32's tokens, and a long context's attention reads half the
    # bytes), or "auto": float16 where quantized weights on blockdot compute in float32 on a CPU, the
    # model's dtype elsewhere (precision.resolve). "q8_0", "q4_0": llama.cpp's blocks of 32 values
    # along each head (8.5 and 4.5 bits a value: ~1.9x and ~3.6x float16's tokens in the same bytes),
    # quantized as they are written, for heads of a multiple of 32 (nanoserve.model.kv_quant).
    # Attention computes in the model's dtype (float32 in the fused decode), each value widened as it
    # is read; quantbench reports what it costs (notes/quantbench.md).
    kv_cache_dtype: str = "auto"
    # A request's tokens depend on its prompt, parameters and seed only, never on what else the engine
    # runs: its logits the same bits alone or beside any other rows, at any width, however its prompt
    # was cut into chunks or found in the prefix cache (an unseeded sampled request draws from the
    # engine's shared generator, which the others advance). "auto": the invariant plan (every step in
    # one C call, prompts too, every matmul on blockdot's or dense panels at every width; under tensor
    # parallelism three C calls a layer between the ranks' matmuls, their partials summed in rank
    # order) wherever the other choices allow it; the exact path, compile, int8, a GPU and the families
    # fused_decode.c does not run keep their own plan, which Engine.plan marks not invariant. True: the
    # invariant plan or a ValueError naming what rules it out (dtype float32 with quantization None
    # then runs on dense panels, not the exact path's torch ops). False: the fastest plan (prompts on
    # torch's matmuls, which are faster past 64 rows; notes/batch-invariance.md has the cost).
    batch_invariant: bool | str = "auto"
    # Speculative decoding (nanoserve.speculative), vLLM's spelling: {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_max": M, "prompt_lookup_min": m}, {"method":
    # "draft_model", "model": PATH, "num_speculative_tokens": k} or a SpeculativeConfig; None: off.
    # Greedy output stays token-identical, so it needs the batch-invariant plan (Engine refuses a
    # config that rules that out); with deferred_output each step's tokens still come home in its own
    # collect, since the next step's proposals are read from them.
    speculative_config: SpeculativeConfig | dict | None = None
    # The execution plan's choices pinned for an experiment (abbench); the defaults leave each to the plan.
    overrides: PlanOverrides = PlanOverrides()
    device: str = "cpu"
    seed: int = 0  # seeds the generator of requests that bring no seed of their own
    # Every layer split across this many processes (nanoserve.parallel): rank 0 is this one and
    # keeps the scheduler, allocator, sampler and output stage; Engine.from_pretrained starts the
    # others (or joins torchrun's). Gloo on a CPU, NCCL on CUDA.
    tensor_parallel_size: int = 1
    # A collective that waits longer (a worker dead or hung) fails the step with WorkerFailure.
    tensor_parallel_timeout_s: float = 60.0
    # Intra-op threads of each rank; None: the CPUs this process may use, divided among the ranks.
    tensor_parallel_threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks!r} must be None or an integer >= 1")
        if self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes!r} must be >= 1")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len={self.max_model_len!r} must be None or an integer >= 2")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {list(_DTYPES)}")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not one of {list(_KV_CACHE_DTYPES)}")
        if self.quantization not in _QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is not one of {list(_QUANTIZATIONS)}")
        if not (isinstance(self.batch_invariant, bool) or self.batch_invariant == "auto"):
            raise ValueError(f"batch_invariant={self.batch_invariant!r} must be True, False or 'auto'")
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
            if self.speculative_config.quantization not in _QUANTIZATIONS:
                raise ValueError(f"speculative_config quantization={self.speculative_config.quantization!r} is not "
                                 f"one of {list(_QUANTIZATIONS)}")
        if not isinstance(self.overrides, PlanOverrides):
            raise ValueError(f"overrides={self.overrides!r} must be a PlanOverrides")
        try:
            torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device={self.device!r} is not a torch device: {e}") from None
        if self.decode_group_min_rows is not None and (
            not isinstance(self.decode_group_min_rows, int) or self.decode_group_min_rows < 2
        ):
            raise ValueError(f"decode_group_min_rows={self.decode_group_min_rows!r} must be None or an integer >= 2")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size!r} must be an integer >= 1")
        if not isinstance(self.tensor_parallel_timeout_s, int | float) or not self.tensor_parallel_timeout_s > 0:
            raise ValueError(f"tensor_parallel_timeout_s={self.tensor_parallel_timeout_s!r} must be > 0")
        if self.tensor_parallel_threads is not None and (
            not isinstance(self.tensor_parallel_threads, int) or self.tensor_parallel_threads < 1
        ):
            raise ValueError(f"tensor_parallel_threads={self.tensor_parallel_threads!r} must be None or an integer >= 1")
        from nanoserve.model.plan import refuse  # the plan's rules, asked before anything is loaded

        refuse(self, self.tensor_parallel_size)
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is below max_model_len="
                f"{self.max_model_len}: without chunked prefill a long prompt could never be scheduled"
            )
