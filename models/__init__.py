"""Encoder models: our own compact PyTorch BERT-family, ModernBERT, NomicBERT, GTE, Jina v3
and EuroBERT encoders, loading HuggingFace checkpoint folders, with their tokenizer and
sentence-transformers pooling and prompts.

    from kernels import AttentionSpec
    from models import load_encoder
    enc = load_encoder(None)                                   # nomic-embed-text-v1.5 (python -m models.fetch)
    vectors = enc.embed(["a long document ..."], AttentionSpec(method="full"))  # (1, 768)
"""

from models.config import EncoderConfig, UnsupportedArchitecture
from models.loader import load_encoder
from models.planning.inputs import InputTooLong
from models.prompts import UnknownPrompt
from models.runtime.encoder import Encoder

__all__ = ["Encoder", "EncoderConfig", "InputTooLong", "UnknownPrompt", "UnsupportedArchitecture", "load_encoder"]
