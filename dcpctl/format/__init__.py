"""The DCP on-disk format: metadata, torch.save archives, stream codecs and the checkpoint view.

Never prints, never uses click.
"""
