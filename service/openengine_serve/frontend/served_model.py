"""The models this frontend serves, learned from the nodes: their names, limits and tokenizers.

The frontend holds no model of its own. Every node's entry in the node table
names its model (ModelCard, without the tokenizer); once a ready node of a model
is known, the frontend asks that node for the full card (Node.GetModel: the
tokenizer as a vocabulary-only GGUF, or the name of the built-in Qwen3 one) and
builds the tokenizer off the event loop. Until one model is loaded the frontend
is not ready. Nodes may serve different models (by the card's name): each model
gets its own tokenizer and limits, and a request names its model. A model whose
ready nodes serve another tokenizer (its nodes replaced by nodes of another
build) is loaded again; a model stays listed while none of its nodes is ready.

The operator's settings (_MAX_CONTEXT_LENGTH, _MAX_OUTPUT_TOKENS) cap every
model's; the context can only shrink. OPENENGINE_MODEL and _MODEL_ALIASES rename
the model of a one-model deployment (with several, each keeps its card's names).
"""

from __future__ import annotations

import asyncio
import dataclasses
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
    """The deployment's models as this frontend serves them: one LoadedModel per model the ready nodes serve (by
    the card's name), each with the tokenizer of a node of that model."""

    def __init__(self, config: FrontendConfig, open_channel: Callable[..., grpc.aio.Channel]) -> None:
        self._config = config
        self._open_channel = open_channel
        self.models: dict[str, LoadedModel] = {}  # by card name
        self.changed = asyncio.Event()  # set when `models` changes (readiness follows it)
        self._loading: dict[str, tuple[str, asyncio.Task]] = {}  # card name -> (tokenizer digest, its load)

    @property
    def loaded(self) -> LoadedModel | None:
        """The default model: the only one, or of several the first by name (GetServerInfo names it first)."""
        return self.models[min(self.models)] if self.models else None

    def names(self) -> list[str]:
        """Every served name and alias, the default model's first."""
        ordered = sorted(self.models.values(), key=lambda m: m is not self.loaded)
        return [name for model in ordered for name in model.limits.served_names]

    def for_name(self, name: str) -> LoadedModel | None:
        """The model served under `name` (its served name or an alias)."""
        return next((m for m in self.models.values() if name in m.limits.served_names), None)

    def on_node_table(self, nodes: dict[str, cluster_pb2.NodeEntry]) -> None:
        """Called at every node table: loads each model a ready node serves and this frontend does not (or serves
        with another tokenizer: its nodes were replaced). A model stays while no node serves it (a coordinator
        that restarted sends an empty table first; a model's nodes may all be restarting)."""
        ready: dict[str, cluster_pb2.NodeEntry] = {}
        for node in nodes.values():
            if node.state == READY and node.model.tokenizer_digest:
                ready.setdefault(node.model.name, node)
        for name, node in ready.items():
            loaded = self.models.get(name)
            if loaded is not None and loaded.serves(node):
                continue
            loading = self._loading.get(name)
            if loading is not None and not loading[1].done():
                if loading[0] == node.model.tokenizer_digest:
                    continue
                loading[1].cancel()
            self._loading[name] = (
                node.model.tokenizer_digest,
                asyncio.create_task(self._load(node), name="load-model"),
            )

    def ready_on(self, nodes) -> bool:
        """A model is loaded and some ready node serves it."""
        return any(n.state == READY and any(m.serves(n) for m in self.models.values()) for n in nodes)

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
        self.models[card.name] = LoadedModel(
            card, tokenizer, self._limits(card, tokenizer), TokenStrings(tokenizer), node.node_id, guide_tokenizer
        )
        self._relimit()
        loaded = self.models[card.name]
        log_event(
            logger,
            "model loaded",
            model=loaded.name,
            engine=card.engine,
            tokenizer=tokenizer.mode,
            vocab_size=tokenizer.n_vocab,
            context_length=loaded.limits.max_context_length,
            from_node=node.node_id,
        )

    def _relimit(self) -> None:
        """The limits of every model again: the operator's name and aliases apply to a deployment of one model."""
        for name, model in self.models.items():
            self.models[name] = dataclasses.replace(model, limits=self._limits(model.card, model.tokenizer))
        self.changed.set()

    def _limits(self, card: cluster_pb2.ModelCard, tokenizer: Tokenizer) -> ModelLimits:
        config = self._config
        context = min(config.max_context_length or card.context_length, card.context_length)
        single = len(self.models) <= 1  # OPENENGINE_MODEL and _MODEL_ALIASES name the model of a one-model deployment
        return ModelLimits(
            served_model_name=(single and config.model) or card.name,
            aliases=config.aliases() if single and config.model_aliases else tuple(card.aliases),
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
