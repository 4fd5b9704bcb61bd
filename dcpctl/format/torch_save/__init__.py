"""`torch.save` archives read and written without torch: zip records, tensor layout, CRC-32
checks."""
