"""Integrations of the GTP engine with megatron-core and TransformerEngine (layer 2)."""
