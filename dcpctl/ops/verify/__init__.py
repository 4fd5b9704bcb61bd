"""`verify`: prove a checkpoint whole, or list everything wrong with it."""
