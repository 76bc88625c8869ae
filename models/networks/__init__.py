"""The encoder networks: BERT, ModernBERT, the rotary BERTs (NomicBERT, GTE, Jina v3) and
EuroBERT, each run a layer at a time over a packed batch (models.runtime.forward), and their
parts: rotary embeddings, LoRA task adapters, feed-forward blocks by rows."""
