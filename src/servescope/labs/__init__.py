"""servescope.labs"""
