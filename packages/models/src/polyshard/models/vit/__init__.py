"""The vision transformer (ViT) image classifier (:mod:`.model`)."""
