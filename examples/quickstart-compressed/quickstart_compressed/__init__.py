"""Flower's PyTorch quickstart on scikit-learn's digits, with fedcomp compression."""
