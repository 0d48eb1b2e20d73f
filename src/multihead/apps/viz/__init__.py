"""``multihead viz``: every head of a model drawn on an input (vision: timm and torchvision models on a picture)."""
