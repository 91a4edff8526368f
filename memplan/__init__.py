"""memplan: will this PyTorch training step fit on my GPU, and if not, what is the cheapest way to make it fit?"""

__version__ = "0.1.0"
