"""Benchmark workloads: the model zoo (VGG-19, ResNet-50, Transformer, char-LSTM, ...) and synthetic data."""
