"""Encoder models: our own compact PyTorch BERT-family, ModernBERT, NomicBERT, GTE, Jina v3
and EuroBERT encoders, loading HuggingFace checkpoint folders, with their tokenizer and
sentence-transformers pooling and prompts.

    from clusterserve.kernels import AttentionSpec
    from clusterserve.models import load_encoder
    enc = load_encoder(None)                                   # nomic-embed-text-v1.5 (clusterserve fetch)
    vectors = enc.embed(["a long document ..."], AttentionSpec(method="full"))  # (1, 768)
"""

from clusterserve.models.config import EncoderConfig, UnsupportedArchitecture
from clusterserve.models.loader import load_encoder
from clusterserve.models.planning.inputs import InputTooLong
from clusterserve.models.prompts import UnknownPrompt
from clusterserve.models.runtime.encoder import Encoder

__all__ = ["Encoder", "EncoderConfig", "InputTooLong", "UnknownPrompt", "UnsupportedArchitecture", "load_encoder"]
