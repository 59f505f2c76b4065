"""One llama.cpp model and context, and the token batch the engine decodes each step.

The context is made as llama.cpp's own server makes one for parallel slots, in
one of its two KV layouts:

- a shared cache (`kv_unified`): any sequence may use any cell, so a request
  may use the model's whole context while others are short. Flash attention is
  on: its CPU kernel skips the cells of other sequences, which a shared cache
  otherwise pays for, though each token still walks every used cell's mask;
- per-sequence streams (`kv_streams`, llama-server's default): sequence i owns
  stream i, n_ctx / n_seq_max cells, and attends to its own cells only. Sharing
  cells between streams copies them (through llama.cpp's per-sequence state:
  the cells a sequence holds, where its own stream copy would move the whole
  stream), and a decode evaluates one graph per run of consecutive sequence
  ids, so the engine keeps its running sequences' ids contiguous and its batch
  in id order.

`n_seq_max` sequence ids, and one micro-batch as large as the step's batch, so
every step is one graph evaluation (a shared cache) or as few as the ids allow.

The batch's arrays are NumPy arrays handed to llama.cpp by pointer, so a step
fills them with slice assignments rather than one ctypes call per token.
"""

from __future__ import annotations

import ctypes

import numpy as np

from openengine_serve.common.llama_library import llama_cpp, model_params, take_errors


class LlamaError(RuntimeError):
    """llama.cpp refused: the model did not load, or a decode failed."""


class TokenBatch:
    """A llama_batch over NumPy arrays: `add` appends a run of one sequence's tokens."""

    def __init__(self, capacity: int) -> None:
        lib = llama_cpp()
        self.capacity = capacity
        self.tokens = np.zeros(capacity, np.int32)
        self.positions = np.zeros(capacity, np.int32)
        self.seq_ids = np.zeros(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        self._n_seq_id = np.ones(capacity, np.int32)
        int_p = ctypes.POINTER(ctypes.c_int32)
        # token i's sequence list is the one-element array at seq_ids[i]
        self._seq_id_pointers = (int_p * capacity)(
            *(ctypes.cast(self.seq_ids.ctypes.data + 4 * i, int_p) for i in range(capacity))
        )
        batch = lib.llama_batch()
        batch.token = self.tokens.ctypes.data_as(int_p)
        batch.embd = None
        batch.pos = self.positions.ctypes.data_as(int_p)
        batch.n_seq_id = self._n_seq_id.ctypes.data_as(int_p)
        batch.seq_id = ctypes.cast(self._seq_id_pointers, ctypes.POINTER(int_p))
        batch.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.native = batch
        self.size = 0

    def clear(self) -> None:
        self.size = 0

    @property
    def room(self) -> int:
        return self.capacity - self.size

    def add(self, tokens, start_position: int, seq_id: int, logits_from: int | None) -> int:
        """Appends `tokens` at positions start_position.. of `seq_id`; logits for the run's tokens from index
        `logits_from` on (None: no logits). Returns the batch index of the run's first token."""
        first, count = self.size, len(tokens)
        end = first + count
        self.tokens[first:end] = tokens
        self.positions[first:end] = np.arange(start_position, start_position + count, dtype=np.int32)
        self.seq_ids[first:end] = seq_id
        self.logits[first:end] = 0
        if logits_from is not None:
            self.logits[first + logits_from : end] = 1
        self.size = end
        return first


class LlamaModel:
    """The loaded GGUF model and its context; every call is made from the worker's one thread."""

    def __init__(
        self,
        path: str,
        *,
        context_size: int,
        batch_tokens: int,
        sequences: int,
        threads: int,
        kv_streams: bool = False,
    ) -> None:
        lib = self._lib = llama_cpp()
        take_errors()
        self._model = lib.llama_model_load_from_file(path.encode(), model_params())
        if not self._model:
            raise LlamaError(f"llama.cpp could not load the model {path}: {take_errors() or 'no reason logged'}")
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.vocab_size = lib.llama_vocab_n_tokens(self._vocab)
        self.trained_context = lib.llama_model_n_ctx_train(self._model)
        # Sliding-window attention (e.g. Gemma 3): llama.cpp reuses the cells that fell out of a sequence's window.
        self.sliding_window = lib.llama_model_n_swa(self._model)
        # Recurrent state (Mamba, RWKV, hybrids) cannot be cut at a position: no partial prefix sharing.
        self.recurrent = bool(lib.llama_model_is_recurrent(self._model) or lib.llama_model_is_hybrid(self._model))
        self.end_of_generation = np.array(
            [t for t in range(self.vocab_size) if lib.llama_vocab_is_eog(self._vocab, t)], np.int32
        )
        params = lib.llama_context_default_params()
        params.n_ctx = context_size
        params.n_batch = params.n_ubatch = batch_tokens
        params.n_seq_max = sequences
        params.n_outputs_max = max(batch_tokens, sequences)  # llama.cpp reserves one output per sequence at least
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = not kv_streams
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.no_perf = True
        self._context = lib.llama_init_from_model(self._model, params)
        if not self._context:
            lib.llama_model_free(self._model)
            raise LlamaError(
                f"llama.cpp could not create a context of {context_size} KV cells for {sequences} "
                f"sequences (see its log above)"
            )
        self.context_size = lib.llama_n_ctx(self._context)
        self.streams = kv_streams
        self._state = (ctypes.c_uint8 * 0)()  # a sequence's state in transit between streams
        self._adapters: dict[str, object] = {}  # name -> llama_adapter_lora pointer
        self._applied: tuple[tuple[str, float], ...] = ()  # the adapters the next decode applies, with scales
        self._memory = lib.llama_get_memory(self._context)
        self._logits_ith = lib.llama_get_logits_ith
        self._float_p = ctypes.POINTER(ctypes.c_float)

    @property
    def context(self):
        """The llama_context, for the samplers."""
        return self._context

    def decode(self, batch: TokenBatch) -> None:
        batch.native.n_tokens = batch.size
        status = self._lib.llama_decode(self._context, batch.native)
        if status != 0:
            # 1: no KV slot for the batch (the engine's accounting keeps it from happening); <0: an error
            raise LlamaError(f"llama_decode failed with status {status} on a batch of {batch.size} tokens")

    def load_adapter(self, name: str, path: str) -> None:
        """Loads a GGUF LoRA adapter of this model under `name`. Raises LlamaError with llama.cpp's reason (not a
        LoRA GGUF, another architecture, shapes of another model)."""
        if name in self._adapters:
            raise LlamaError(f"a LoRA adapter named {name!r} is loaded already")
        take_errors()
        adapter = self._lib.llama_adapter_lora_init(self._model, path.encode())
        if not adapter:
            raise LlamaError(f"llama.cpp could not load the LoRA adapter {path}: {take_errors() or 'no reason logged'}")
        self._adapters[name] = adapter

    def unload_adapter(self, name: str) -> None:
        """Frees the adapter (the caller no longer decodes with it)."""
        if any(applied == name for applied, _ in self._applied):
            self.apply_adapters(())
        self._lib.llama_adapter_lora_free(self._adapters.pop(name))

    def apply_adapters(self, adapters: tuple[tuple[str, float], ...]) -> None:
        """The adapters (name, scale) the next decodes apply; () for the base model. llama.cpp applies them to
        the whole context, so one decode serves one set: the engine decodes each set's sequences apart."""
        if adapters == self._applied:
            return
        lib = self._lib
        pointers = (lib.llama_adapter_lora_p_ctypes * len(adapters))(*(self._adapters[n] for n, _ in adapters))
        scales = (ctypes.c_float * len(adapters))(*(scale for _, scale in adapters))
        if lib.llama_set_adapters_lora(self._context, pointers, len(adapters), scales) != 0:
            raise LlamaError(f"llama.cpp could not apply the LoRA adapters {[n for n, _ in adapters]}")
        self._applied = adapters

    def logits(self, batch_index: int) -> np.ndarray:
        """The logits row of the token at `batch_index` of the last decode (writable: masks apply in place)."""
        pointer = self._logits_ith(self._context, batch_index)
        return np.ctypeslib.as_array(ctypes.cast(pointer, self._float_p), shape=(self.vocab_size,))

    def forget(self, seq_id: int) -> None:
        """Frees every KV cell of the sequence."""
        self._lib.llama_memory_seq_rm(self._memory, seq_id, -1, -1)

    def last_position(self, seq_id: int) -> int:
        """The highest position the sequence holds in the KV cache; -1 when it holds none."""
        return self._lib.llama_memory_seq_pos_max(self._memory, seq_id)

    def can_share_prefix(self, seq_id: int, length: int) -> bool:
        """Whether a sequence given the first `length` cells of `seq_id` can go on from them. With a sliding
        window, the next token attends to the window before it, and llama.cpp may have reused the cells of
        `seq_id` that fell out of its own window: the test is llama-server's (lowest position held)."""
        if self.recurrent:
            return False
        if not self.sliding_window:
            return True
        return self._lib.llama_memory_seq_pos_min(self._memory, seq_id) <= max(0, length - self.sliding_window)

    def share_prefix(self, source_seq_id: int, target_seq_id: int, start: int, end: int) -> None:
        """The target sequence gets the source's KV cells of positions [start, end) (all it holds below `start`
        came from the source)."""
        if self.streams:  # every cell of the source is copied: those from `end` on are dropped
            self.share(source_seq_id, target_seq_id)
            self._lib.llama_memory_seq_rm(self._memory, target_seq_id, end, -1)
            return
        self._lib.llama_memory_seq_cp(self._memory, source_seq_id, target_seq_id, start, end)

    def move(self, source_seq_id: int, target_seq_id: int) -> None:
        """The target sequence takes over the source's cells (in streams: a copy at the next decode)."""
        self.share(source_seq_id, target_seq_id)
        self.forget(source_seq_id)

    def guide_tokenizer(self):
        """llguidance's view of the model's vocabulary (for the guides' token masks)."""
        from openengine_serve.common.guides import vocabulary

        return vocabulary(self._vocab)

    def share(self, source_seq_id: int, target_seq_id: int) -> None:
        """The target sequence gets the source's KV cells (shared in a unified cache, copied between streams)."""
        if not self.streams:
            self._lib.llama_memory_seq_cp(self._memory, source_seq_id, target_seq_id, -1, -1)
            return
        written = self._save_state(source_seq_id)
        if not written or not self._lib.llama_state_seq_set_data(self._context, self._state, written, target_seq_id):
            raise LlamaError(f"llama.cpp could not copy the KV cells of sequence {source_seq_id} to {target_seq_id}")

    def _save_state(self, seq_id: int) -> int:
        """Writes the sequence's llama.cpp state into `self._state` (grown as needed); the bytes written (0: none)."""
        size = self._lib.llama_state_seq_get_size(self._context, seq_id)
        if len(self._state) < size:
            self._state = (ctypes.c_uint8 * size)()
        return self._lib.llama_state_seq_get_data(self._context, self._state, size, seq_id)

    def export_sequence(self, seq_id: int) -> bytes | None:
        """The sequence's KV cells as llama.cpp's per-sequence state of a one-stream cache, which `import_sequence`
        of another context over the same model takes; None when llama.cpp wrote none or in an unknown form, and
        for models with a sliding window (their state holds two caches)."""
        if self.sliding_window or self.recurrent:
            return None
        written = self._save_state(seq_id)
        return one_stream_state(ctypes.string_at(self._state, written)) if written else None

    def import_sequence(self, seq_id: int, state: bytes) -> bool:
        """The sequence takes the cells `export_sequence` gave (False, nothing taken, when llama.cpp refuses them,
        e.g. for want of room). Unified caches only: a stream context's state names every stream."""
        assert not self.streams, "import_sequence restores into a unified KV cache"
        data = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if self._lib.llama_state_seq_set_data(self._context, data, len(state), seq_id):
            return True
        self.forget(seq_id)
        return False

    def close(self) -> None:
        if self._context:
            self._lib.llama_free(self._context)
            self._context = None
        if self._model:
            self._lib.llama_model_free(self._model)
            self._model = None


_U32 = 4
_HEADER = 2 * _U32  # llama.cpp's per-sequence state: a magic number and the sequence's id, then its memory's state


def one_stream_state(state: bytes) -> bytes | None:
    """llama.cpp's state of one sequence as a one-stream cache holds it. After the header, the KV cache writes its
    stream count, then per stream a u32 cell count and, when not 0, the cells; a sequence's cells are all in its
    own stream, so the other streams are zero counts around it: dropped here, the count set to 1. None for any
    other layout."""
    if len(state) < _HEADER + 2 * _U32:
        return None
    streams = int.from_bytes(state[_HEADER : _HEADER + _U32], "little")
    if streams == 1:
        return state
    offset = _HEADER + _U32
    for stream in range(streams):
        if offset + _U32 > len(state):
            return None
        if int.from_bytes(state[offset : offset + _U32], "little"):
            end = len(state) - _U32 * (streams - stream - 1)  # the streams after it: a zero count each
            if end <= offset or any(state[end:]):
                return None
            return state[:_HEADER] + (1).to_bytes(_U32, "little") + state[offset:end]
        offset += _U32
    return None  # the sequence holds no cell
