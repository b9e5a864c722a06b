"""servescope.model"""
