"""The model this frontend serves, learned from the nodes: its names, limits and tokenizer.

The frontend holds no model of its own. Every node's entry in the node table
names its model (ModelCard, without the tokenizer); once a ready node is known,
the frontend asks that node for the full card (Node.GetModel: the tokenizer as a
vocabulary-only GGUF, or the name of the built-in Qwen3 one) and builds the
tokenizer off the event loop. Until then the frontend is not ready. A node
table whose ready nodes all serve another tokenizer (every node replaced by
nodes of another model) makes the frontend load that one.

The operator's settings (OPENENGINE_MODEL, _MODEL_ALIASES, _MAX_CONTEXT_LENGTH,
_MAX_OUTPUT_TOKENS) override the card's; the context can only shrink.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from ..api.openengine_internal.v1 import cluster_pb2, cluster_pb2_grpc
from ..common.config import FrontendConfig
from ..common.logging_setup import log_event
from ..common.tokenizers import GgufTokenizer, Tokenizer, tokenizer_for
from .limits import DEFAULT_MAX_PROMPT_BYTES
from .stream import TokenStrings
from .validation import ModelLimits

logger = logging.getLogger("openengine_serve.frontend")

READY = cluster_pb2.NODE_STATE_READY
MAX_TOP_N = 20
MAX_CANDIDATE_TOKEN_IDS = 20  # asked candidate ids per selection, at most (as many as top_n)
MAX_STOP_CONDITIONS = 16
# OPENENGINE_MAX_PROMPT_BYTES' default per token of the context: text averages 3-5 bytes per token, so a prompt
# that fits is far below it, and one above it is refused before it is tokenized.
PROMPT_BYTES_PER_TOKEN = 16
GET_MODEL_TIMEOUT_S = 30.0  # the tokenizer of a large vocabulary is several MB
# The largest model card (with its tokenizer) a frontend takes from a node: a vocabulary-only GGUF of a 262k-token
# vocabulary is about 10 MB. A larger one is refused by the channel before it is kept.
MAX_MODEL_CARD_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class LoadedModel:
    card: cluster_pb2.ModelCard  # without tokenizer_data
    tokenizer: Tokenizer
    limits: ModelLimits
    strings: TokenStrings  # token id -> text, cached per tokenizer
    node_id: str  # the node the tokenizer came from
    guide_tokenizer: object = None  # llguidance's view of the vocabulary, to compile guides (guided decoding)

    @property
    def name(self) -> str:
        return self.limits.served_model_name

    def serves(self, entry: cluster_pb2.NodeEntry) -> bool:
        return entry.model.tokenizer_digest == self.card.tokenizer_digest


class ServedModel:
    def __init__(self, config: FrontendConfig, open_channel: Callable[..., grpc.aio.Channel]) -> None:
        self._config = config
        self._open_channel = open_channel
        self.loaded: LoadedModel | None = None
        self.changed = asyncio.Event()  # set when `loaded` changes (readiness follows it)
        self._loading: asyncio.Task | None = None
        self._loading_digest = ""

    def on_node_table(self, nodes: dict[str, cluster_pb2.NodeEntry]) -> None:
        """Called at every node table: starts loading a ready node's model when none of them serves ours."""
        ready = [n for n in nodes.values() if n.state == READY and n.model.tokenizer_digest]
        if not ready or (self.loaded is not None and any(self.loaded.serves(n) for n in ready)):
            return
        if self._loading is not None and not self._loading.done():
            if any(n.model.tokenizer_digest == self._loading_digest for n in ready):
                return
            self._loading.cancel()
        self._loading_digest = ready[0].model.tokenizer_digest
        self._loading = asyncio.create_task(self._load(ready[0]), name="load-model")

    def ready_on(self, nodes) -> bool:
        """A model is loaded and some ready node serves it."""
        loaded = self.loaded
        return loaded is not None and any(n.state == READY and loaded.serves(n) for n in nodes)

    async def _load(self, node: cluster_pb2.NodeEntry) -> None:
        try:
            options = (("grpc.max_receive_message_length", MAX_MODEL_CARD_BYTES),)
            async with self._open_channel(node.address, options=options) as channel:
                card = await cluster_pb2_grpc.NodeStub(channel).GetModel(
                    cluster_pb2.GetModelRequest(), timeout=GET_MODEL_TIMEOUT_S
                )
            tokenizer = await asyncio.to_thread(tokenizer_for, card)
            guide_tokenizer = None
            if card.guided_decoding:
                # A node offers guided decoding with a llama.cpp (GGUF) vocabulary only (node/model.py).
                assert isinstance(tokenizer, GgufTokenizer)
                guide_tokenizer = await asyncio.to_thread(tokenizer.guide_tokenizer)
        except (grpc.aio.AioRpcError, ValueError, OSError) as exc:
            # The next node table (within a heartbeat) tries again.
            detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            log_event(
                logger,
                "model load failed",
                logging.WARNING,
                node_id=node.node_id,
                detail=detail,
                max_model_card_bytes=MAX_MODEL_CARD_BYTES,
            )
            return
        card.ClearField("tokenizer_data")
        self.loaded = LoadedModel(
            card, tokenizer, self._limits(card, tokenizer), TokenStrings(tokenizer), node.node_id, guide_tokenizer
        )
        self.changed.set()
        log_event(
            logger,
            "model loaded",
            model=self.loaded.name,
            engine=card.engine,
            tokenizer=tokenizer.mode,
            vocab_size=tokenizer.n_vocab,
            context_length=self.loaded.limits.max_context_length,
            from_node=node.node_id,
        )

    def _limits(self, card: cluster_pb2.ModelCard, tokenizer: Tokenizer) -> ModelLimits:
        config = self._config
        context = min(config.max_context_length or card.context_length, card.context_length)
        return ModelLimits(
            served_model_name=config.model or card.name,
            aliases=config.aliases() if config.model_aliases else tuple(card.aliases),
            max_context_length=context,
            max_output_tokens=min(config.max_output_tokens or card.max_output_tokens, context),
            max_num_sequences=config.max_num_sequences,
            max_top_n=MAX_TOP_N,
            max_candidate_token_ids=MAX_CANDIDATE_TOKEN_IDS,
            max_stop_conditions=MAX_STOP_CONDITIONS,
            vocab_size=tokenizer.n_vocab,
            engine=card.engine,
            guided_decoding=card.guided_decoding,
            prefix_cache=card.prefix_cache,
            max_loras=card.max_loras,
            max_guide_bytes=config.max_guide_bytes,
            max_prompt_bytes=config.max_prompt_bytes or min(PROMPT_BYTES_PER_TOKEN * context, DEFAULT_MAX_PROMPT_BYTES),
        )
