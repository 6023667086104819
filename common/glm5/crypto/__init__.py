"""Payload encryption (SM4-GCM envelopes)."""
