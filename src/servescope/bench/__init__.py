"""servescope.bench"""
