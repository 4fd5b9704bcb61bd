"""`convert`: DCP to safetensors or torch.save, and back to DCP."""
