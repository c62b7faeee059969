"""Converters to and from other toolkits: CTranslate2 and Hugging Face transformers (Marian)."""
