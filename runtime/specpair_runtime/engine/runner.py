"""One model, its static KV storage, and one forward over a flat ragged batch."""

from __future__ import annotations

import torch

from specpair_runtime.engine.attention import model_attention
from specpair_runtime.engine.decoder import DecoderLoop
from specpair_runtime.engine.graphs import GraphStep
from specpair_runtime.engine.kvcache import (
    KVGeometry,
    KVStorage,
    RowSpan,
    SlotCache,
    build_flat_batch,
)
from specpair_runtime.engine.loading import LoadedModel


class ModelRunner:
    """Runs ``loaded.model`` over flat batches that read and write ``self.storage``."""

    def __init__(
        self,
        loaded: LoadedModel,
        slots: int,
        max_length: int,
        *,
        cuda_graphs: bool = False,
        compile_graphs: bool = False,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.slots = slots
        self.max_length = max_length
        self.head = self.model.get_output_embeddings()
        # out_features also exists on quantized heads, whose .weight is a method.
        width = getattr(self.head, "out_features", None)
        self.vocab = int(width if width is not None else self.model.config.vocab_size)
        embeddings = self.model.get_input_embeddings()
        self.embedding_rows = int(getattr(embeddings, "num_embeddings", self.vocab))
        self.geometry = KVGeometry.of(self.model.config)
        text = self.model.config.get_text_config()
        self.groups = int(text.num_attention_heads) // self.geometry.kv_heads
        # The engine's own loop where it knows the model (fused projections), else HF's forward.
        self.decoder = DecoderLoop.of(self.model)
        self.storage: KVStorage | None = None
        self.allocate()
        on_cuda = cuda_graphs and self.device.type == "cuda"
        self.graphs = GraphStep(self, compile=compile_graphs) if on_cuda else None

    def allocate(self) -> KVStorage:
        if self.storage is None:
            self.storage = KVStorage(
                self.geometry, self.slots, self.max_length, self.device, self.dtype
            )
        return self.storage

    def free(self) -> None:
        self.storage = None

    def forward(
        self,
        rows: list[RowSpan],
        input_ids: torch.Tensor,
        sample_index: torch.Tensor | None,
        *,
        dense: bool = False,
    ) -> torch.Tensor | None:
        """Write the KV of ``input_ids`` [T] (laid out as ``rows``) and return logits.

        Returns float logits [N, V] at the flat positions ``sample_index`` [N],
        or None without computing the head when ``sample_index`` is None.
        """
        storage = self.allocate()
        if self.graphs is not None and not dense and self.graphs.accepts(rows, sample_index):
            assert sample_index is not None
            return self.graphs(rows, input_ids, sample_index)
        batch = build_flat_batch(rows, self.device, self.groups, dense=dense)
        # A draft with fewer embedding rows than the target's logits (vocab
        # padding) must still read every committed id; past the tokenizer
        # these ids are junk anyway, and the draft only proposes.
        ids = input_ids.clamp(max=self.embedding_rows - 1)[None, :]
        hidden = self.hidden_states(ids, SlotCache(storage, batch))
        if sample_index is None:
            return None
        logits: torch.Tensor = self.head(hidden[0].index_select(0, sample_index))
        return logits

    def hidden_states(self, input_ids: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        """The final hidden states [1, T, hidden] of ``input_ids`` [1, T] laid out by ``cache``."""
        if self.decoder is not None:
            return self.decoder(input_ids, cache)
        with model_attention(self.model):
            out = self.model.base_model(
                input_ids=input_ids,
                position_ids=cache.batch.position_ids,
                cache=cache,
                use_cache=True,
            )
        hidden: torch.Tensor = out.last_hidden_state
        return hidden
