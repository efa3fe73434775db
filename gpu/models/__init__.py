"""The Llama-family models: their config, where their files are, their weights, their forward
(in torch, or its decode steps with the layer loop in C)."""
